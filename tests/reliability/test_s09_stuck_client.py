"""Scenario 9: a client that stops reading a stream cannot hold the gateway's memory or a worker's KV
blocks: after `stream_idle_timeout_s` without taking a message, its request is cancelled.

The stuck client opens its stream with a 1 KiB HTTP/2 receive window (no BDP probing), reads the
first message and then nothing, so the gateway's writes stop completing once the window is full; the
real tokenizer service, worker and gateway run in-process on loopback.
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
WAIT_S = 30.0


def _stuck(model: str) -> float:
    return REGISTRY.get_sample_value("strata_gateway_stuck_streams_total", {"model": model}) or 0.0


def test_a_client_that_stops_reading_loses_its_request_and_frees_the_worker(
    tiny_serving_dir: Path, figure: Figure
) -> None:
    # Slow steps keep the request running long after the client stops reading.
    worker = {"engine": {"enable_fault_injection": True, "fault_step_delay_s": 0.02}}
    gateway = {"stream_idle_timeout_s": IDLE_TIMEOUT_S}

    async def main() -> tuple[float, int]:
        async with tiny_stack(tiny_serving_dir, worker=worker, gateway=gateway) as stack:
            return await asyncio.to_thread(_stop_reading, stack.gateway.address, stack.worker.address)

    before = _stuck("tiny")
    freed_after, generated = asyncio.run(main())
    assert _stuck("tiny") == before + 1, "the gateway cancelled the stream for its idle client"
    assert generated < 240, "the request was cut short, not run to its end"
    # Not before the idle timeout; the time the window took to fill comes on top.
    assert freed_after >= IDLE_TIMEOUT_S
    figure(9, "KV blocks freed after the client stopped reading", freed_after, "s")
    figure(9, "idle timeout", IDLE_TIMEOUT_S, "s")
    figure(9, "tokens the stuck client had been sent", generated)


def _stop_reading(gateway: str, worker: str) -> tuple[float, int]:
    """Read one message, then nothing until the worker has let the request go; (seconds, tokens)."""
    request = gateway_pb2.GenerateRequest(
        model="tiny",
        prompt="a",
        sampling=common_pb2.SamplingParams(max_new_tokens=240, ignore_eos=True),
    )
    with grpc.insecure_channel(gateway, options=STUCK_WINDOW) as channel:
        stream = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(request, timeout=120)
        assert next(stream).token_ids
        stopped = time.monotonic()  # from here the client reads nothing
        with grpc.insecure_channel(worker) as worker_channel:
            stats = worker_pb2_grpc.WorkerServiceStub(worker_channel)
            wait_for(
                lambda: stats.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=5),
                WAIT_S,
                "the stuck stream let go of the worker",
                until=lambda now: not (now.open_requests or now.running or now.used_kv_blocks),
                interval_s=0.05,
            )
        return time.monotonic() - stopped, _generated(stream)


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
