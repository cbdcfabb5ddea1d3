"""The concurrent stream driver of `strata bench`: N closed-loop GenerateStream callers on one event loop.

One level runs a fixed list of prompts through `concurrency` streams: each stream sends a request,
reads its stream to the end, then takes the next prompt (closed loop), so at most `concurrency`
requests are in flight and the level ends when the list is used up. It talks to the gateway through
the raw grpc.aio stub on one channel, the cheapest client Python has, and stamps every message on
arrival. This module measures and summarizes one level; it must not start or stop a stack, load a
model or decide what a sweep is (bench/stack.py does).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from tqdm import tqdm

from bench.stats import percentile
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Sequence

    from bench.stack_prompts import Prompt

# Overload answers: the stack declined the request, it did not fail. Every other code is an error.
REFUSAL_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED.name})
PERCENTILES = (50.0, 95.0, 99.0)


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request: times relative to its send, tokens, and the usage it was told."""

    index: int
    status: str
    """"OK", or the gRPC status code's name."""
    ttft_s: float | None
    e2e_s: float
    itl_s: list[float]
    token_ids: list[int] = field(default_factory=list)
    usage_input_tokens: int | None = None
    usage_output_tokens: int | None = None


@dataclass(slots=True)
class LevelRun:
    """Every request of one level, and the level's wall time from the first send to the last answer."""

    concurrency: int
    wall_s: float
    results: list[RequestResult]


def token_timing(sent: float, arrivals: Sequence[tuple[float, int]]) -> tuple[float | None, list[float]]:
    """Time to first token and the inter-token gaps, from (arrival time, tokens in message) pairs.

    A message carrying k tokens counts as k gaps of (its arrival - the previous token message's) / k:
    the stack may coalesce tokens, and a per-message gap would overstate each token's wait k-fold.
    The tokens that share the first message have no gap of their own (their wait is in the TTFT).
    Messages without tokens (a partial character, the final summary) are skipped.
    """
    ttft: float | None = None
    previous = sent
    gaps: list[float] = []
    for arrived, count in arrivals:
        if count <= 0:
            continue
        if ttft is None:
            ttft = arrived - sent
        else:
            gaps.extend([(arrived - previous) / count] * count)
        previous = arrived
    return ttft, gaps


def make_request(
    prompt: Prompt, new_tokens: int, request_id: str, model: str = ""
) -> gateway_pb2.GenerateRequest:
    """Raw text, greedy, EOS ignored: every request generates exactly `new_tokens` tokens."""
    sampling = common_pb2.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return gateway_pb2.GenerateRequest(
        prompt=prompt.text, model=model, sampling=sampling, request_id=request_id
    )


async def _one_request(
    stub: gateway_pb2_grpc.GatewayAsyncStub,
    index: int,
    request: gateway_pb2.GenerateRequest,
    timeout_s: float,
) -> RequestResult:
    arrivals: list[tuple[float, int]] = []
    token_ids: list[int] = []
    final: gateway_pb2.GenerateResponse | None = None
    status = "OK"
    sent = time.perf_counter()
    try:
        async for message in stub.GenerateStream(request, timeout=timeout_s):
            arrived = time.perf_counter()
            if message.token_ids:
                arrivals.append((arrived, len(message.token_ids)))
                token_ids.extend(message.token_ids)
            if message.HasField("final"):
                final = message.final
    except grpc.aio.AioRpcError as exc:
        status = exc.code().name
    e2e = time.perf_counter() - sent
    ttft, gaps = token_timing(sent, arrivals)
    return RequestResult(
        index=index,
        status=status,
        ttft_s=ttft,
        e2e_s=e2e,
        itl_s=gaps,
        token_ids=token_ids,
        usage_input_tokens=final.usage.input_tokens if final is not None else None,
        usage_output_tokens=final.usage.output_tokens if final is not None else None,
    )


async def run_level(
    stub: gateway_pb2_grpc.GatewayAsyncStub,
    requests: Sequence[gateway_pb2.GenerateRequest],
    concurrency: int,
    *,
    timeout_s: float,
    label: str,
    progress: bool = True,
) -> LevelRun:
    """Send `requests` through `concurrency` closed-loop streams; a progress bar on stderr."""
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
            result = await _one_request(stub, index, requests[index], timeout_s)
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


def latency_percentiles(seconds: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99 in milliseconds; None when nothing was measured (every request failed)."""
    return {f"p{q:g}": (1000.0 * percentile(seconds, q) if seconds else None) for q in PERCENTILES}


def check_tokens(result: RequestResult, input_tokens: int, new_tokens: int) -> list[str]:
    """How a successful request's token counts differ from the workload's; empty when they match."""
    if result.usage_output_tokens is None or result.usage_input_tokens is None:
        return ["no final message with usage"]
    problems = []
    if result.usage_input_tokens != input_tokens:
        problems.append(f"usage.input_tokens={result.usage_input_tokens}, the prompt has {input_tokens}")
    if result.usage_output_tokens != new_tokens:
        problems.append(f"usage.output_tokens={result.usage_output_tokens}, asked for {new_tokens}")
    if len(result.token_ids) != result.usage_output_tokens:
        problems.append(f"streamed {len(result.token_ids)} tokens, usage says {result.usage_output_tokens}")
    return problems


def summarize_level(run: LevelRun, input_tokens: Sequence[int], new_tokens: int) -> dict[str, Any]:
    """One level's record: throughput, latency percentiles, refusals and errors by code, mismatches.

    Output tokens/s counts every token received (failed requests' too) over the level's wall time;
    latencies come from the successful requests only.
    """
    ok = [r for r in run.results if r.status == "OK"]
    refusals = Counter(r.status for r in run.results if r.status in REFUSAL_CODES)
    errors = Counter(r.status for r in run.results if r.status != "OK" and r.status not in REFUSAL_CODES)
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
    }
