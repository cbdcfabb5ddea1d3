"""Scenario 1: a burst against the admission limits of a real stack (separate processes).

The worker holds CREDITS requests and the route queues QUEUE more; each admitted request runs for
seconds (the worker's test-mode step delay), so nothing finishes while the burst arrives. Exactly
N - (CREDITS + QUEUE) requests must be refused with RESOURCE_EXHAUSTED and a RetryInfo in the
`grpc-status-details-bin` trailer, and every admitted one must complete with all its tokens.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc

from gateway.errors import STATUS_DETAILS_KEY, retry_delay_s
from strata.cli.launcher import start_stack
from strata.v1 import gateway_pb2, gateway_pb2_grpc
from tests.polling import seconds_until
from tests.reliability.harness import queued_requests, request, worker_stats, write_config

if TYPE_CHECKING:
    from pathlib import Path

    from tests.figures import Figure

CREDITS = 4
QUEUE = 4
NEW_TOKENS = 30
STEP_DELAY_S = 0.1  # an admitted request runs >= 3 s: none ends while the burst arrives


def test_a_burst_refuses_exactly_the_excess_with_a_retry_hint(
    tiny_serving_dir: Path, tmp_path: Path, full: bool, figure: Figure
) -> None:
    count = 200 if full else 50
    engine = {
        "num_blocks": 128,
        "max_num_seqs": CREDITS,
        "enable_fault_injection": True,
        "fault_step_delay_s": STEP_DELAY_S,
    }
    config = write_config(
        tmp_path / "stack.yaml",
        tiny_serving_dir,
        engine=engine,
        worker={"max_requests": CREDITS},
        route={"max_queued_requests": QUEUE, "ttft_slo_ms": 0},
    )
    with start_stack(config, log_dir=tmp_path / "logs", ready_timeout_s=300) as stack:

        async def burst() -> list[tuple[float, gateway_pb2.GenerateResponse | grpc.aio.AioRpcError]]:
            async with grpc.aio.insecure_channel(stack.addresses.gateway) as channel:
                await channel.channel_ready()
                stub = gateway_pb2_grpc.GatewayStub(channel)

                async def one(i: int) -> tuple[float, gateway_pb2.GenerateResponse | grpc.aio.AioRpcError]:
                    started = time.monotonic()
                    try:
                        answer = await stub.Generate(
                            request(f"burst {i}: the quick fox", NEW_TOKENS), timeout=120
                        )
                    except grpc.aio.AioRpcError as error:
                        return time.monotonic() - started, error
                    return time.monotonic() - started, answer

                return await asyncio.gather(*(one(i) for i in range(count)))

        started = time.monotonic()
        results = asyncio.run(burst())
        elapsed = time.monotonic() - started
        refused = [(s, r) for s, r in results if isinstance(r, grpc.aio.AioRpcError)]
        accepted = [r for _, r in results if not isinstance(r, grpc.aio.AioRpcError)]
        assert len(refused) == count - (CREDITS + QUEUE), {(e.code(), e.details()) for _, e in refused}
        for _, error in refused:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            hint = retry_delay_s(dict(error.trailing_metadata() or ())[STATUS_DETAILS_KEY])
            assert hint is not None and hint > 0, error.details()
        assert len(accepted) == CREDITS + QUEUE
        assert all(len(answer.token_ids) == NEW_TOKENS for answer in accepted)
        # The refusals were decided at once, long before the first admitted request could end (3 s).
        slowest_refusal = max(seconds for seconds, _ in refused)
        assert slowest_refusal < NEW_TOKENS * STEP_DELAY_S
        worker = stack.addresses.workers[0]
        seconds_until(lambda: worker_stats(worker).open_requests == 0, 30, "the worker went idle")
        assert queued_requests(stack.addresses.gateway) == 0
    figure(1, "requests in the burst", count)
    figure(1, "refused RESOURCE_EXHAUSTED with RetryInfo", len(refused), f"of {count}")
    figure(1, "accepted and completed", len(accepted), f"= {CREDITS} credits + {QUEUE} queued")
    figure(1, "max refusal latency", slowest_refusal * 1000, "ms")
    figure(1, "burst wall time", elapsed, "s")
