"""Scenario 7: a soak of many requests with mixed lengths, cancels and short deadlines.

A real stack (separate processes, the tiny model, no step delay) takes COUNT requests from CLIENTS
concurrent asyncio clients: most are plain (mixed prompt and output lengths, each must complete with
all its tokens), some are streams the client cancels after its first tokens, some carry deadlines
short enough to end them in the queue or mid-generation (DEADLINE_EXCEEDED, or RESOURCE_EXHAUSTED
when the gateway predicts the wait exceeds them). Afterwards the worker's running and waiting
counts, used KV blocks and free KV tokens, its open requests and the gateway's queue must be back
exactly at their values before the soak, with the prefix cache warm (blocks the requests left cached are
evictable, and free plus evictable is the whole cache: a warm cache looks exactly as free as a cold
one); each service's resident memory after the warm-up (the
first tenth) is compared with its value at the end and may grow by 20% at most.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import TYPE_CHECKING

import grpc

from strata.cli.launcher import start_stack
from strata.v1 import gateway_pb2_grpc
from tests.polling import seconds_until
from tests.reliability.harness import (
    queued_requests,
    request,
    rss_bytes,
    worker_stats,
    write_config,
)

if TYPE_CHECKING:
    from pathlib import Path

    from tests.figures import Figure

CLIENTS = 16
WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "small",
    "cat",
    "sleeps",
)
SERVICES = ("tokenizer", "worker 0", "gateway")


def _plan(count: int) -> list[tuple[str, str, int, float]]:
    """(kind, prompt, max_new_tokens, deadline) per request; kind: plain, cancel or deadline."""
    rng = random.Random(7)
    plan = []
    for i in range(count):
        prompt = f"soak {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        roll = rng.random()
        kind = "cancel" if roll < 0.1 else "deadline" if roll < 0.2 else "plain"
        plan.append((kind, prompt, rng.randint(1, 48), rng.uniform(0.02, 0.3)))
    return plan


async def _one(
    stub: gateway_pb2_grpc.GatewayStub, kind: str, prompt: str, new_tokens: int, deadline: float
) -> str:
    """The request's outcome: ok, cancelled, or a status code's name; 'short' for missing tokens."""
    try:
        if kind == "cancel":
            call = stub.GenerateStream(request(prompt, max(new_tokens, 8)), timeout=120)
            async for message in call:
                if message.token_ids:
                    call.cancel()
                    break
            return "cancelled"
        answer = await stub.Generate(
            request(prompt, new_tokens), timeout=deadline if kind == "deadline" else 120
        )
    except grpc.aio.AioRpcError as error:
        return str(error.code().name)
    return "ok" if len(answer.token_ids) == new_tokens else "short"


def _state(worker: str, gateway: str) -> tuple[int, ...]:
    stats = worker_stats(worker)
    return (
        stats.running,
        stats.waiting,
        stats.used_kv_blocks,
        stats.free_kv_tokens,
        stats.open_requests,
        queued_requests(gateway),
    )


def test_soak_returns_to_the_initial_state(
    tiny_serving_dir: Path, tmp_path: Path, full: bool, figure: Figure
) -> None:
    count = 5000 if full else 300
    engine = {"num_blocks": 256, "max_num_seqs": 16, "max_num_batched_tokens": 256}
    config = write_config(tmp_path / "stack.yaml", tiny_serving_dir, engine=engine)
    plan = _plan(count)
    warm_up = max(30, count // 10)
    with start_stack(config, log_dir=tmp_path / "logs", ready_timeout_s=300) as stack:
        worker, gateway = stack.addresses.workers[0], stack.addresses.gateway
        initial = _state(worker, gateway)
        outcomes: dict[str, Counter[str]] = {"plain": Counter(), "cancel": Counter(), "deadline": Counter()}
        rss_warm: dict[str, int] = {}

        async def soak() -> None:
            async with grpc.aio.insecure_channel(gateway) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                for start, end in ((0, warm_up), (warm_up, count)):
                    queue = list(reversed(plan[start:end]))

                    async def client(queue: list[tuple[str, str, int, float]] = queue) -> None:
                        while queue:
                            kind, prompt, new_tokens, deadline = queue.pop()
                            outcomes[kind][await _one(stub, kind, prompt, new_tokens, deadline)] += 1

                    await asyncio.gather(*(client() for _ in range(CLIENTS)))
                    if start == 0:
                        rss_warm.update({name: rss_bytes(stack.pids[name]) for name in SERVICES})

        started = time.monotonic()
        asyncio.run(soak())
        elapsed = time.monotonic() - started
        settled = seconds_until(lambda: _state(worker, gateway) == initial, 30, "back to the initial state")
        final = _state(worker, gateway)
        warm = worker_stats(worker)
        rss_end = {name: rss_bytes(stack.pids[name]) for name in SERVICES}
        assert stack.poll() is None

    figure(7, "requests", count, f"in {elapsed:.0f} s, {CLIENTS} clients")
    for kind, counter in outcomes.items():
        figure(7, f"{kind} requests: outcomes", ", ".join(f"{k} {v}" for k, v in sorted(counter.items())))
    figure(7, "running, waiting, used KV blocks, free KV tokens, open, queued: before", str(initial))
    figure(7, "the same after the soak", str(final), f"(settled in {settled:.2f} s)")
    for name in SERVICES:
        growth = (rss_end[name] - rss_warm[name]) / rss_warm[name] * 100
        figure(7, f"{name}: RSS after warm-up -> end", f"{rss_warm[name] >> 20} -> {rss_end[name] >> 20} MiB")
        figure(7, f"{name}: RSS growth", growth, "%")
    figure(7, "prefix cache after the soak: evictable blocks", warm.evictable_kv_blocks)
    assert final == initial
    assert warm.evictable_kv_blocks > 0 and warm.used_kv_blocks == 0
    assert warm.free_kv_tokens == warm.total_kv_blocks * 16  # the default block_size
    assert set(outcomes["plain"]) == {"ok"}, outcomes["plain"]
    assert set(outcomes["cancel"]) <= {"cancelled"}, outcomes["cancel"]
    assert set(outcomes["deadline"]) <= {"ok", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}, outcomes[
        "deadline"
    ]
    assert sum(sum(counter.values()) for counter in outcomes.values()) == count
    for name in SERVICES:
        assert rss_end[name] <= 1.2 * rss_warm[name], (name, rss_warm[name], rss_end[name])
