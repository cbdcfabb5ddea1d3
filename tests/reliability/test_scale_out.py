"""Scale-out across replicas: two worker processes of one model behind one gateway, found by a name.

Both replicas listen on the same port of two loopback addresses (127.0.0.1 and 127.0.0.2), and one
host name resolves to both, as a Kubernetes headless service's name resolves to its pods. The name
comes from a hosts file that nss_wrapper (Debian's libnss-wrapper, LD_PRELOADed into the stack's
processes) puts in front of the system's resolver: real getaddrinfo, no change to the machine. The
route is `dns: workers.strata.test:<port>`. While clients stream, one replica is killed with
SIGKILL; traffic goes on on the other, and no request fails that had not started streaming (those
that had are continued on the survivor, token for token).
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from strata.cli.launcher import start_stack
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from strata.cli.launcher import Stack

pytestmark = pytest.mark.slow

NAME = "workers.strata.test"
REPLICAS = ("127.0.0.1", "127.0.0.2")
STEP_DELAY_S = 0.02
NEW_TOKENS = 24
CLIENTS = 6
WAIT_S = 60.0


def nss_wrapper() -> str:
    """The nss_wrapper library; the test fails (it does not skip) without it."""
    found = sorted(glob.glob("/usr/lib/*/libnss_wrapper.so")) + sorted(
        glob.glob("/usr/lib/libnss_wrapper.so")
    )
    assert found, (
        "libnss_wrapper.so is missing: apt-get install libnss-wrapper (scripts/install_test_deps.sh)"
    )
    return found[0]


def free_port_on_both() -> int:
    """A port free on every replica address."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((REPLICAS[0], 0))
            port = int(probe.getsockname()[1])
            try:
                with socket.socket() as other:
                    other.bind((REPLICAS[1], port))
            except OSError:
                continue
            return port
    raise AssertionError("no port free on both loopback addresses")


@pytest.fixture(scope="module")
def stack(tiny_serving_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("scale-out")
    hosts = directory / "hosts"
    hosts.write_text("".join(f"{address} {NAME}\n" for address in REPLICAS))
    port = free_port_on_both()
    worker = {
        "model_name": "tiny",
        "model_path": str(tiny_serving_dir),
        "device": "cpu",
        "threads": 1,
        "engine": {
            "num_blocks": 128,
            "max_num_seqs": 8,
            "enable_fault_injection": True,
            "fault_step_delay_s": STEP_DELAY_S,
        },
    }
    config = {
        "telemetry": {"log_format": "text"},
        "tokenizer": {"listen": "127.0.0.1:0", "models": {"tiny": str(tiny_serving_dir)}},
        "workers": [{**worker, "listen": f"{address}:{port}"} for address in REPLICAS],
        "gateway": {
            "listen": "127.0.0.1:0",
            "routes": [{"model": "tiny", "dns": f"{NAME}:{port}", "dns_refresh_s": 0.5}],
        },
    }
    path = directory / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {"LD_PRELOAD": nss_wrapper(), "NSS_WRAPPER_HOSTS": str(hosts)}
    with start_stack(path, env=env, log_dir=directory / "logs") as running:
        yield running


@dataclass
class Outcome:
    started: float
    streamed: bool
    """The client had received at least one chunk."""
    error: grpc.StatusCode | None
    tokens: int


def _client(address: str, stop: threading.Event, outcomes: list[Outcome]) -> None:
    request = gateway_pb2.GenerateRequest(
        model="tiny",
        prompt="The capital of France",
        sampling=common_pb2.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        while not stop.is_set():
            outcome = Outcome(time.monotonic(), False, None, 0)
            try:
                for chunk in stub.GenerateStream(request, timeout=WAIT_S):
                    outcome.streamed = True
                    outcome.tokens += len(chunk.token_ids)
            except grpc.RpcError as exc:
                outcome.error = exc.code()  # type: ignore[attr-defined]
            outcomes.append(outcome)


def _submissions(stack: Stack) -> dict[str, float]:
    """strata_gateway_worker_submissions_total per worker address, from the gateway's /metrics."""
    with urllib.request.urlopen(f"http://{stack.metrics_addresses['gateway']}/metrics", timeout=10) as page:
        text = page.read().decode()
    return {
        sample.labels["worker"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "strata_gateway_worker_submissions_total"
    }


def test_traffic_goes_on_when_one_replica_is_killed(stack: Stack) -> None:
    with grpc.insecure_channel(stack.addresses.gateway) as channel:
        [model] = gateway_pb2_grpc.GatewayStub(channel).ListModels(gateway_pb2.ListModelsRequest()).models
    assert (model.ready_workers, model.configured_workers) == (2, 2), "both replicas found by the name"

    stop = threading.Event()
    outcomes: list[Outcome] = []
    clients = [
        threading.Thread(target=_client, args=(stack.addresses.gateway, stop, outcomes))
        for _ in range(CLIENTS)
    ]
    for client in clients:
        client.start()
    time.sleep(2.0)
    before = _submissions(stack)
    assert len(before) == 2 and all(count > 0 for count in before.values()), before
    victim = stack.pids["worker 1"]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    time.sleep(3.0)
    stop.set()
    for client in clients:
        client.join(WAIT_S)
    after = _submissions(stack)

    failed_before_streaming = [o for o in outcomes if o.error is not None and not o.streamed]
    assert not failed_before_streaming, f"{len(failed_before_streaming)} requests failed before any token"
    survivor = next(address for address in after if address.startswith(REPLICAS[0]))
    assert after[survivor] > before[survivor] + CLIENTS, "the survivor took the traffic"
    done_after_kill = [o for o in outcomes if o.started > killed_at and o.error is None]
    assert len(done_after_kill) >= CLIENTS
    assert all(o.tokens == NEW_TOKENS for o in outcomes if o.error is None)
    mid_stream = [o for o in outcomes if o.error is not None]
    print(
        f"{len(outcomes)} requests, {len(done_after_kill)} completed after the kill, {len(mid_stream)} failed"
    )
