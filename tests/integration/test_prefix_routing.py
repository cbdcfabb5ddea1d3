"""Prefix-aware routing across two real workers behind one gateway route (all in-process).

Requests that share a long system prompt must reach the worker that has it cached: after each
prompt's first request, every later one is served its prefix from that worker's cache (the
response's Usage.cached_input_tokens), which could not happen if they were spread across replicas
by load alone; and a burst of one prefix is spread by the load bound rather than piled on one
worker.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from strata.v1 import gateway_pb2_grpc, worker_pb2
from tests.integration.tiny_stack import tiny_stack
from tests.reliability.harness import request

if TYPE_CHECKING:
    from pathlib import Path

    from strata.v1 import gateway_pb2

# 16 prompts: the ring's points depend on the workers' OS-given ports, so 4 prompts would all land on
# one replica in 1 run of 8; 16 do in 1 of 32,768.
SYSTEMS = [
    f"System {name}: " + f"you answer questions about {name} briefly and kindly. " * 2
    for name in "ABCDEFGHIJKLMNOP"
]
WAIT_S = 60.0


async def _worker_hits(address: str) -> tuple[int, int]:
    from strata.v1 import worker_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stats = await worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerStats(  # type: ignore[misc]
            worker_pb2.GetWorkerStatsRequest(), timeout=10
        )
    return int(stats.prefix_cache_hit_blocks), int(stats.prefix_cache_query_blocks)


def test_requests_sharing_a_prefix_reach_the_worker_that_cached_it(tiny_serving_dir: Path) -> None:
    """16 system prompts x 3 requests, one at a time, over 2 workers that both serve some: every
    request after the first of its prompt is served that prompt's blocks from cache, so the two
    workers together hit 32 of 48 requests' prefixes: with both replicas in use, that holds only if
    each prompt keeps to the replica that cached it."""

    async def main() -> list[gateway_pb2.GenerateResponse]:
        async with tiny_stack(tiny_serving_dir, replicas=2) as stack:
            async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                answers = []
                for turn in range(3):
                    for system in SYSTEMS:
                        prompt = f"{system} Question {turn}?"
                        answers.append(await stub.Generate(request(prompt, 4), timeout=WAIT_S))
            hits = [await _worker_hits(worker.address) for worker in stack.workers]
            assert all(queried > 0 for _, queried in hits), f"one worker got nothing: {hits}"
            return answers

    answers = asyncio.run(main())
    later = answers[len(SYSTEMS) :]
    assert all(answer.usage.cached_input_tokens >= 64 for answer in later), [
        answer.usage.cached_input_tokens for answer in later
    ]


def test_a_burst_of_one_prefix_is_spread_by_the_load_bound(tiny_serving_dir: Path) -> None:
    """16 concurrent requests of one prefix on 2 workers: the prefix's replica takes them only while
    within 1.25x the average load, so the other worker serves some too (its stats count queries)."""

    async def main() -> list[tuple[int, int]]:
        async with tiny_stack(
            tiny_serving_dir,
            replicas=2,
            worker={"engine": {"fault_step_delay_s": 0.02, "enable_fault_injection": True}},
        ) as stack:
            async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                calls = [
                    stub.Generate(request(f"{SYSTEMS[0]} Burst {i}?", 8), timeout=WAIT_S) for i in range(16)
                ]
                await asyncio.gather(*calls)
            return [await _worker_hits(worker.address) for worker in stack.workers]

    hits = asyncio.run(main())
    assert all(queried > 0 for _, queried in hits), f"the burst piled on one worker: {hits}"
