"""Scenario 9: a client that stops reading a stream cannot hold the gateway's memory or a worker's KV
blocks: after `stream_idle_timeout_s` without taking a message, its request is cancelled.

The stuck client opens its stream with a 1 KiB HTTP/2 receive window (no BDP probing), reads the
first message and then nothing, so the gateway's writes stop completing once the window is full; the
real tokenizer service, worker and gateway run in-process on loopback. The request asks for
NEW_TOKENS tokens at a STEP_DELAY_S sleep before every engine step, so it cannot end by itself before
NATURAL_S (60 s): blocks freed well before that were freed by the cancel. The model is the tiny one
with a context long enough for that many tokens (tiny_long_serving_dir).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
from prometheus_client import REGISTRY

from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.tiny_stack import tiny_stack
from tests.polling import wait_for

if TYPE_CHECKING:
    from pathlib import Path

    from tests.figures import Figure

IDLE_TIMEOUT_S = 1.0
STUCK_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
STEP_DELAY_S = 0.02
NEW_TOKENS = 3000
NATURAL_S = NEW_TOKENS * STEP_DELAY_S
"""The least time the request takes to end by itself: every step sleeps STEP_DELAY_S first."""
EXPECTED_S = 5.0
"""From the client's last read to the free: the window filling (about 140 tokens, about 4 s of
steps on a loaded 2-core machine) plus the 1 s idle timeout plus the cancel's trip (milliseconds)."""
BOUND_S = 5 * EXPECTED_S


def _stuck(model: str) -> float:
    return REGISTRY.get_sample_value("strata_gateway_stuck_streams_total", {"model": model}) or 0.0


def test_a_client_that_stops_reading_loses_its_request_and_frees_the_worker(
    tiny_long_serving_dir: Path, figure: Figure
) -> None:
    worker = {"engine": {"enable_fault_injection": True, "fault_step_delay_s": STEP_DELAY_S}}
    gateway = {"stream_idle_timeout_s": IDLE_TIMEOUT_S}

    async def main() -> tuple[float, int]:
        async with tiny_stack(tiny_long_serving_dir, worker=worker, gateway=gateway) as stack:
            return await asyncio.to_thread(_stop_reading, stack.gateway.address, stack.worker.address)

    assert BOUND_S < NATURAL_S / 2, "the bound must lie well before the request's natural end"
    before = _stuck("tiny")
    freed_after, generated = asyncio.run(main())
    figure(9, "KV blocks freed after the client stopped reading", freed_after, "s")
    figure(9, "idle timeout", IDLE_TIMEOUT_S, "s")
    figure(9, "the request's natural end, at the earliest", NATURAL_S, f"s ({NEW_TOKENS} tokens)")
    figure(9, "tokens the stuck client had been sent", generated)
    assert _stuck("tiny") == before + 1, "the gateway cancelled the stream for its idle client"
    assert generated < NEW_TOKENS, "the request was cut short, not run to its end"
    # Not before the idle timeout (the time the window took to fill comes on top); long before the
    # request could have ended by itself, so the idle timeout is what freed the blocks.
    assert IDLE_TIMEOUT_S <= freed_after < BOUND_S


def _stop_reading(gateway: str, worker: str) -> tuple[float, int]:
    """Read one message, then nothing until the worker has let the request go; (seconds, tokens).

    The wait gives up at BOUND_S, far before the request's natural end: without the idle timeout the
    blocks stay held that long and the test fails here.
    """
    request = gateway_pb2.GenerateRequest(
        model="tiny",
        prompt="a",
        sampling=common_pb2.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
    )
    with grpc.insecure_channel(gateway, options=STUCK_WINDOW) as channel:
        stream = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(request, timeout=NATURAL_S * 2)
        assert next(stream).token_ids
        stopped = time.monotonic()  # from here the client reads nothing
        with grpc.insecure_channel(worker) as worker_channel:
            stats = worker_pb2_grpc.WorkerServiceStub(worker_channel)
            wait_for(
                lambda: stats.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=5),
                BOUND_S,
                "the stuck stream let go of the worker (the idle timeout cancelled it)",
                until=lambda now: not (now.open_requests or now.running or now.used_kv_blocks),
                interval_s=0.05,
            )
        freed_after = time.monotonic() - stopped
        return freed_after, _generated(stream)


def _generated(stream: grpc.Call) -> int:
    """The tokens the client can still read out of its window once it resumes, before the cancel."""
    tokens = 0
    try:
        for message in stream:  # type: ignore[attr-defined]
            tokens += len(message.token_ids)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.CANCELLED  # type: ignore[attr-defined]
        assert "stream_idle_timeout_s" in (error.details() or "")  # type: ignore[attr-defined]
    return tokens + 1
