"""The open loop of `strata bench --rate`: a seeded arrival schedule and requests sent on it.

Requests leave on the schedule whatever the stack answers (open loop): Poisson arrivals (exponential
gaps of mean 1/R drawn from `random.Random(seed)`, the first at 0) by default, or a fixed interval 1/R.
Each request is raw text, greedy with ignore_eos, interactive priority; fallback on sets
allow_fallback, fallback off sets no_fallback (and not allow_fallback), so the fallback serves none of
them. Each is sent by bench/driver.py's `send`, told when it was due. The primary's capacity is a
closed loop of no_fallback requests (bench/load.py): completed requests/s. This module schedules; it
must not start a stack, pick the rates, nor reduce the figures (bench/rate_run.py and
bench/rate_phase.py do).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from bench.driver import make_request, send
from bench.load import run_level, summarize_level
from strata.v1 import gateway_pb2

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    from bench.driver import Metadata, RequestResult, Stub
    from bench.stack_prompts import Prompt

# Between phases the gateway's queues must read empty within this bound (every answer is in by then).
DRAIN_TIMEOUT_S = 60.0


def arrival_offsets(rate: float, count: int, process: str, seed: str) -> list[float]:
    """Send times in seconds from the phase's start: Poisson (seeded) or a fixed interval, the first at 0."""
    if rate <= 0 or count < 1:
        raise ValueError(f"rate={rate} must be > 0 and count={count} >= 1")
    if process == "fixed":
        return [index / rate for index in range(count)]
    if process != "poisson":
        raise ValueError(f"arrival process {process!r}: poisson or fixed")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def arrivals_per_phase(rate: float, duration_s: float, arrivals: int | None) -> int:
    """--arrivals when given, else the requests R/s makes in --duration (at least one)."""
    return arrivals if arrivals is not None else max(1, round(rate * duration_s))


def rate_request(
    prompt: Prompt, new_tokens: int, request_id: str, model: str, *, fallback: bool
) -> gateway_pb2.GenerateRequest:
    """Greedy, EOS ignored, interactive; fallback on: allow_fallback; off: no_fallback, never the fallback."""
    request = make_request(prompt, new_tokens, request_id, model)
    request.priority = gateway_pb2.PRIORITY_INTERACTIVE
    request.allow_fallback = fallback
    request.no_fallback = not fallback
    return request


async def run_phase(
    stub: Stub,
    requests: Sequence[gateway_pb2.GenerateRequest],
    offsets: Sequence[float],
    *,
    timeout_s: float,
    label: str,
    progress: bool = True,
    metadata: Metadata | None = None,
) -> tuple[list[RequestResult], float]:
    """Send each request at its offset without waiting for answers, each call with `metadata`; every
    result and the wall time."""
    results: list[RequestResult] = []
    bar = tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr, disable=not progress)

    async def one(index: int, due: float) -> None:
        results.append(await send(stub, index, requests[index], timeout_s, due=due, metadata=metadata))
        bar.update(1)

    tasks = []
    start = time.perf_counter()
    try:
        for index, offset in enumerate(offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index, start + offset)))
        await asyncio.gather(*tasks)
    finally:
        bar.close()
    return sorted(results, key=lambda r: r.index), time.perf_counter() - start


async def drain(stub: Stub, gap_s: float, metadata: Metadata | None = None) -> None:
    """Wait until no route has queued requests, then stay idle `gap_s`, so a phase starts on an idle stack."""
    end = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        models = await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10.0, metadata=metadata)
        if all(m.queued_requests == 0 for m in models.models):
            break
        if time.monotonic() >= end:
            raise TimeoutError(f"the gateway's queues did not empty within {DRAIN_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.2)
    await asyncio.sleep(gap_s)


async def warm_up(stub: Stub, args: argparse.Namespace, prompts: list[Prompt], routes: list[str]) -> None:
    """Untimed: a few requests to each route (the fallback is a route of its own), all at once."""
    requests = [
        rate_request(p, args.new_tokens, f"bench-warmup-{route}-{i}", route, fallback=False)
        for route in routes
        for i, p in enumerate(prompts)
    ]
    if requests:
        await run_level(
            stub, requests, len(requests), timeout_s=args.timeout, label="warm-up", progress=False
        )


async def measure_capacity(
    stub: Stub,
    args: argparse.Namespace,
    prompts: list[Prompt],
    model: str,
    concurrency: int,
    metadata: Metadata | None = None,
) -> dict[str, Any]:
    """The primary alone (no_fallback), closed loop at `concurrency` streams: completed requests/s."""
    requests = [
        rate_request(p, args.new_tokens, f"bench-capacity-{i}", model, fallback=False)
        for i, p in enumerate(prompts)
    ]
    run = await run_level(
        stub, requests, concurrency, timeout_s=args.timeout, label="capacity",
        progress=not args.no_progress, metadata=metadata,
    )  # fmt: skip
    summary = summarize_level(run, [len(p.token_ids) for p in prompts], args.new_tokens)
    keys = (
        "requests",
        "completed",
        "wall_s",
        "requests_per_s",
        "output_tok_s",
        "ttft_ms",
        "refusals",
        "errors",
    )
    return {"concurrency": concurrency, **{key: summary[key] for key in keys}}
