"""Scenario 4: SIGTERM to each service in turn (tokenizer, worker, gateway) while streams run.

Each case starts a fresh stack with the launcher (separate processes; every service also serves
health on a plaintext health-only port, bound to a port the OS chooses and announced to the launcher,
so its readiness stays observable while its main port drains), starts its streams, waits until each
has its first token, and SIGTERMs one service. The streams running at SIGTERM are counted, not
assumed: those that had received a token and had not ended when the signal was sent (and the worker's
GetWorkerStats `running`, read just before it).
A health Watch on that service's health port sees NOT_SERVING before the streams are done; a new
call through the gateway gets UNAVAILABLE; the process exits with code 0 before its grace period
ends; and the launcher reports the ended child and starts nothing in its place.

Gateway and worker: every running stream finishes with all its tokens (the gateway's
shutdown_grace_s, the worker's drain_timeout_s). Tokenizer: the gateway detokenizes every update
through the tokenizer service, so streams running when it stops cannot finish; what must hold is
that each either completes or ends promptly with UNAVAILABLE (never hangs, never INTERNAL or
UNKNOWN). Its grace is its shutdown_grace_s (5 s by default).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from strata.cli.launcher import ChildExit, start_stack
from strata.v1 import gateway_pb2_grpc
from tests.polling import poll, wait_for
from tests.reliability.harness import NOT_SERVING, SERVING, health, request, worker_stats, write_config

if TYPE_CHECKING:
    from pathlib import Path

    from tests.figures import Figure

GRACE_S = 10.0
TOKENIZER_GRACE_S = 5.0  # the tokenizer's default shutdown_grace_s
NEW_TOKENS = 40
STEP_DELAY_S = 0.05  # a stream runs >= 2 s
CHILD = {"tokenizer": "tokenizer", "worker": "worker 0", "gateway": "gateway"}


@dataclass
class Stream:
    tokens: int = 0
    first: threading.Event = field(default_factory=threading.Event)
    first_token_at: float = 0.0
    """When its first token arrived; 0.0 when none did."""
    code: grpc.StatusCode | None = None
    details: str = ""
    ended: float = 0.0


def _run(stub: gateway_pb2_grpc.GatewayStub, index: int, stream: Stream) -> None:
    try:
        for message in stub.GenerateStream(request(f"stream {index} of the drain", NEW_TOKENS), timeout=60):
            if message.token_ids and not stream.first_token_at:
                stream.first_token_at = time.monotonic()
            stream.tokens += len(message.token_ids)
            stream.first.set()
    except grpc.RpcError as error:
        stream.code = error.code()  # type: ignore[attr-defined]
        stream.details = error.details() or ""  # type: ignore[attr-defined]
    stream.ended = time.monotonic()
    stream.first.set()


def _group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` (a child runs in a session of its own) lives."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _watch_not_serving(address: str, seen: list[tuple[float, int]], watching: threading.Event) -> None:
    """Follow the health of `address` until NOT_SERVING or the end of its server."""
    with grpc.insecure_channel(address) as channel:
        try:
            for reply in health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(), timeout=60
            ):
                seen.append((time.monotonic(), int(reply.status)))
                watching.set()
                if reply.status == NOT_SERVING:
                    return
        except grpc.RpcError:
            seen.append((time.monotonic(), -1))
        finally:
            watching.set()


@pytest.mark.parametrize("victim", ["tokenizer", "worker", "gateway"])
def test_sigterm_drains_under_load(
    victim: str, tiny_serving_dir: Path, tmp_path: Path, full: bool, figure: Figure
) -> None:
    streams_n = 32 if full else 8
    engine = {
        "num_blocks": 256,
        "max_num_seqs": 32,
        "enable_fault_injection": True,
        "fault_step_delay_s": STEP_DELAY_S,
    }
    config = write_config(
        tmp_path / "stack.yaml",
        tiny_serving_dir,
        engine=engine,
        worker={"drain_timeout_s": GRACE_S, "health_listen": "127.0.0.1:0"},
        gateway={"shutdown_grace_s": GRACE_S, "health_listen": "127.0.0.1:0"},
        tokenizer={"health_listen": "127.0.0.1:0"},
    )
    grace = TOKENIZER_GRACE_S if victim == "tokenizer" else GRACE_S
    with start_stack(config, log_dir=tmp_path / "logs", ready_timeout_s=300) as stack:
        health_address = stack.health_addresses[CHILD[victim]]
        assert health(health_address) == SERVING
        seen: list[tuple[float, int]] = []
        watching = threading.Event()
        watcher = threading.Thread(target=_watch_not_serving, args=(health_address, seen, watching))
        watcher.start()
        assert watching.wait(10) and seen[0][1] == SERVING
        channel = grpc.insecure_channel(stack.addresses.gateway)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        streams = [Stream() for _ in range(streams_n)]
        threads = [threading.Thread(target=_run, args=(stub, i, s)) for i, s in enumerate(streams)]
        for thread in threads:
            thread.start()
        assert all(s.first.wait(60) for s in streams) and all(s.code is None for s in streams)
        pid = stack.pids[CHILD[victim]]
        engine_running = worker_stats(stack.addresses.workers[0]).running
        term = time.monotonic()
        os.kill(pid, signal.SIGTERM)

        watcher.join(10)
        not_serving_at = next((at for at, status in seen if status == NOT_SERVING), None)
        assert not_serving_at is not None, f"{victim}'s health never reported NOT_SERVING: {seen}"
        running_then = sum(1 for s in streams if not s.ended or s.ended > not_serving_at)
        assert running_then > 0, "NOT_SERVING came only after every stream had ended"

        with grpc.insecure_channel(stack.addresses.gateway) as fresh:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                gateway_pb2_grpc.GatewayStub(fresh).Generate(request("a new call", 4), timeout=10)
            refusal_s = time.monotonic() - started
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()

        for thread in threads:
            thread.join(grace + 30)
        ended = poll(stack.poll, term + grace + 30 - time.monotonic(), until=lambda child: child is not None)
        exited_s = time.monotonic() - term
        channel.close()
        completed = [s for s in streams if s.code is None and s.tokens == NEW_TOKENS]
        failed = [s for s in streams if s.code is not None]
        last_stream_s = max(s.ended for s in streams) - term
        running_at_term = sum(1 for s in streams if 0 < s.first_token_at <= term and not 0 < s.ended <= term)
        # Figures first, so the report has them when an assertion below fails.
        figure(
            4,
            f"{victim}: streams running at SIGTERM (a token in, not ended)",
            running_at_term,
            f"of {streams_n}",
        )
        figure(4, f"{victim}: the worker's running requests just before SIGTERM", engine_running)
        figure(4, f"{victim}: NOT_SERVING after SIGTERM", (not_serving_at - term) * 1000, "ms")
        figure(4, f"{victim}: streams completed", len(completed), f"of {streams_n}")
        if failed:
            codes = sorted({str(s.code) for s in failed})
            figure(4, f"{victim}: streams ended with an error", len(failed), f"of {streams_n}: {codes}")
        figure(4, f"{victim}: new call refused UNAVAILABLE in", refusal_s * 1000, "ms")
        figure(4, f"{victim}: last stream ended after SIGTERM", last_stream_s, "s")
        figure(4, f"{victim}: process exited after SIGTERM", exited_s, f"s (grace {grace:.0f} s)")

        assert running_at_term == streams_n, "every stream was running when SIGTERM was sent"
        assert ended == ChildExit(CHILD[victim], 0), ended
        if victim == "tokenizer":
            assert {s.code for s in failed} <= {grpc.StatusCode.UNAVAILABLE}, {
                (s.code, s.details) for s in failed
            }
            assert len(completed) + len(failed) == streams_n
        else:
            assert len(completed) == streams_n, [(s.code, s.tokens) for s in streams]
        assert last_stream_s < grace
        assert exited_s < grace, f"{victim} exited {exited_s:.2f} s after SIGTERM, grace {grace} s"
        # The launcher restarts nothing: start_stack runs no supervisor (`strata up` does, tested on
        # its own), so no restart can come later than the child's end; once nothing of the child's
        # process group is left, the launcher still reports that same child ended under its old pid,
        # and nothing answers on its health port.
        wait_for(lambda: not _group_alive(pid), 30, f"every process of the {victim}'s group gone")
        assert stack.poll() == ended and stack.pids[CHILD[victim]] == pid
        assert health(health_address) is None
