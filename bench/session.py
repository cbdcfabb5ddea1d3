"""What both `strata bench` runs share around their load: the stack to drive, the gateway's channel,
and the record, plot and table they publish.

The stack is `--address`, or one started here from `--config` (`--spawn`) and stopped on the way
out (`spawned`, which a benchmark that starts a stack per contestant uses too); its gateway's /metrics
address is the launcher's for a spawned stack, else `--gateway-metrics`, else unknown. The gateway
is reached over one grpc.aio channel, checked with a ListModels call whose answer (the routes, the
default model) the runs record. The closed loop (bench/stack_run.py), the open loop
(bench/rate_run.py) and the tenants' run (bench/tenant_run.py) import this module; it must not
import any of them, nor send a generation request.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import grpc

from bench.config_copy import admit_all, write_config
from bench.stats import save_record
from strata.rpc import MIB, channel_options
from strata.settings import DEFAULT_CONFIG, SettingsError
from strata.v1 import gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    import argparse
    from collections.abc import AsyncIterator, Callable, Iterator, Mapping

    from bench.driver import Metadata, Stub

# A running stack answers ListModels at once; nothing listening fails fast (no wait_for_ready).
CONNECT_TIMEOUT_S = 10.0


class BenchError(RuntimeError):
    """The benchmark cannot run (no stack, no model, a bad config); the message says what to do."""


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where the stack answers: the gateway's gRPC address and its /metrics host:port (None: unknown)."""

    gateway: str
    gateway_metrics: str | None
    http: str | None = None
    """host:port of the gateway's HTTP API; None when unknown or off."""
    pids: Mapping[str, int] = field(default_factory=dict)
    """A spawned stack's process ids by service name ("gateway", "worker 0", ...); empty otherwise."""
    metrics: Mapping[str, str] = field(default_factory=dict)
    """A spawned stack's /metrics host:port by service name; empty otherwise."""


@contextlib.contextmanager
def stack_endpoints(args: argparse.Namespace, admit: int | None = None) -> Iterator[Endpoints]:
    """The gateway to drive: --address, or a stack started here and stopped on the way out. With
    `admit`, a spawned stack's routes admit that many requests at once (config_copy.admit_all): a
    closed loop measures serving, not admission; the rate benchmark, whose subject admission is,
    passes None and keeps the config's routes."""
    if not args.spawn:
        yield Endpoints(args.address, args.gateway_metrics)
        return
    config = args.config or DEFAULT_CONFIG
    # The services' output would tear through the progress bars: it goes to files instead.
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="strata-bench-logs-"))
    if admit is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        config = write_config(config, log_dir, "stack", {"gateway": admit_all(config, admit)})
    print(f"strata bench: starting the stack of {config} (logs in {log_dir})", file=sys.stderr, flush=True)
    with spawned(config, log_dir) as endpoints:
        yield endpoints


@contextlib.contextmanager
def spawned(config: Path, log_dir: Path) -> Iterator[Endpoints]:
    """A stack started from `config`, its gateway on a free port and its services' output in files
    under `log_dir`; stopped on the way out."""
    from strata.cli.launcher import StackError, start_stack

    try:
        # A free port: the default 50051 may belong to a stack someone else is running.
        stack = start_stack(
            config,
            env={"STRATA_GATEWAY_LISTEN": "127.0.0.1:0", "STRATA_GATEWAY_HTTP_LISTEN": "127.0.0.1:0"},
            log_dir=log_dir,
        )
    except (StackError, SettingsError) as exc:
        raise BenchError(f"the stack did not start: {exc}") from exc
    try:
        yield Endpoints(
            stack.addresses.gateway,
            stack.metrics_addresses.get("gateway"),
            stack.http_addresses.get("gateway"),
            stack.pids,
            stack.metrics_addresses,
        )
    finally:
        stack.stop()


@contextlib.asynccontextmanager
async def gateway(
    address: str, metadata: Metadata | None = None
) -> AsyncIterator[tuple[Stub, gateway_pb2.ListModelsResponse]]:
    """A stub on one channel to the gateway at `address`, and its ListModels answer (asked with
    `metadata`: an API key, where the gateway wants one)."""
    async with grpc.aio.insecure_channel(address, options=channel_options(16 * MIB)) as channel:
        stub = cast("Stub", gateway_pb2_grpc.GatewayStub(channel))
        try:
            models = await stub.ListModels(
                gateway_pb2.ListModelsRequest(), timeout=CONNECT_TIMEOUT_S, metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise BenchError(
                f"no gateway answers at {address} ({exc.code().name}: {exc.details()}); "
                "start one with `strata up`, or pass --spawn"
            ) from exc
        yield stub, models


def publish(
    record: dict[str, Any],
    args: argparse.Namespace,
    report: str,
    plot: Callable[[dict[str, Any], Path], None],
) -> int:
    """Save the record and its plot, print the report; 1 when the record is void."""
    save_record(record, args.json)
    if args.plot is not None:
        plot(record, args.plot)
    print(report)
    for path in (args.json, args.plot):
        if path is not None:
            print(f"wrote {path}")
    if record["voided"]:
        print(
            "strata bench: requests failed or miscounted tokens: these numbers do not count", file=sys.stderr
        )
        return 1
    if args.smoke:
        print("strata bench: --smoke run: not a valid result", file=sys.stderr)
    return 0
