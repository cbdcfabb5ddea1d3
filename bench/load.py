"""The closed loop of `strata bench`: N concurrent streams on one event loop, and one level's summary.

One level runs a fixed list of requests through `concurrency` streams: each stream sends a request
(bench/driver.py's `send`), reads its stream to the end, then takes the next one (closed loop), so
at most `concurrency` requests are in flight and the level ends when the list is used up. This
module schedules and summarizes one level; it must not start or stop a stack, load a model or
decide what a sweep is (bench/stack_run.py does).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from bench.driver import RequestResult, send
from bench.summary import REFUSAL_CODE, check_tokens, latency_percentiles

if TYPE_CHECKING:
    from collections.abc import Sequence

    from bench.driver import Metadata, Stub
    from strata.v1 import gateway_pb2


@dataclass(slots=True)
class LevelRun:
    """Every request of one level, and the level's wall time from the first send to the last answer."""

    concurrency: int
    wall_s: float
    results: list[RequestResult]


async def run_level(
    stub: Stub,
    requests: Sequence[gateway_pb2.GenerateRequest],
    concurrency: int,
    *,
    timeout_s: float,
    label: str,
    progress: bool = True,
    metadata: Metadata | None = None,
) -> LevelRun:
    """Send `requests` through `concurrency` closed-loop streams, each call with `metadata`; a progress
    bar on stderr."""
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency} must be >= 1")
    results: list[RequestResult | None] = [None] * len(requests)
    pending = iter(range(len(requests)))  # shared by the streams: each takes the next index when free
    bar = tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr, disable=not progress)
    tokens = 0
    started = time.perf_counter()

    async def stream() -> None:
        nonlocal tokens
        for index in pending:
            result = await send(stub, index, requests[index], timeout_s, metadata=metadata)
            results[index] = result
            tokens += len(result.token_ids)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - started):.1f} tok/s", refresh=False)
            bar.update(1)

    try:
        await asyncio.gather(*(stream() for _ in range(min(concurrency, len(requests)))))
    finally:
        bar.close()
    wall = time.perf_counter() - started
    return LevelRun(concurrency, wall, [r for r in results if r is not None])


def summarize_level(run: LevelRun, input_tokens: Sequence[int], new_tokens: int) -> dict[str, Any]:
    """One level's record: throughput, latency percentiles, refusals and errors by code, mismatches.

    Output tokens/s counts every token received (failed requests' too) over the level's wall time;
    latencies come from the successful requests only.
    """
    ok = [r for r in run.results if r.status == "OK"]
    refusals = Counter(r.status for r in run.results if r.status == REFUSAL_CODE)
    errors = Counter(r.status for r in run.results if r.status not in ("OK", REFUSAL_CODE))
    mismatches = [
        {"request": r.index, "problems": problems}
        for r in ok
        if (problems := check_tokens(r, input_tokens[r.index], new_tokens))
    ]
    output_tokens = sum(len(r.token_ids) for r in run.results)
    return {
        "concurrency": run.concurrency,
        "requests": len(run.results),
        "completed": len(ok),
        "wall_s": run.wall_s,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / run.wall_s,
        "requests_per_s": len(ok) / run.wall_s,
        "ttft_ms": latency_percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": latency_percentiles([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": latency_percentiles([r.e2e_s for r in ok]),
        "refusals": dict(refusals),
        "errors": dict(errors),
        "token_mismatches": len(mismatches),
        "token_mismatch_examples": mismatches[:3],
        "draft_tokens": sum(r.draft_tokens for r in ok),
        "accepted_draft_tokens": sum(r.accepted_draft_tokens for r in ok),
    }
