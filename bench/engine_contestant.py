"""Our engine as a contestant of `python -m bench.engine`: its configuration, its timed runs, and
its run through the asyncio facade.

`engine_config_for` sizes the KV cache so every request runs at once and turns the prefix cache off
(the timed runs repeat the warm-up's prompts). `engine_run` times one greedy `generate` over the prompts
and keeps its step log and the decode rate of its full-batch steps; `without_native` is the same run
with the native CPU kernels off; `measure_async` runs the prompts once through AsyncEngine, probing
the event loop's lag. The transformers contestants live in bench/baselines.py; this module must not
check parity, alternate runs, nor decide what is reported (bench/engine.py does).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bench.stats import lag_summary, probe_event_loop

if TYPE_CHECKING:
    import argparse

Run = Callable[[], tuple[list[list[int]], float]]
"""One timed run of a contestant: its outputs, one token list per prompt, and its seconds."""


def engine_config_for(args: argparse.Namespace) -> Any:
    """The engine's settings for the benchmark's requests and options."""
    from services.worker.engine.config import EngineConfig

    defaults = EngineConfig()
    block = defaults.block_size
    per_request = math.ceil((args.prompt_tokens + args.new_tokens) / block)
    return EngineConfig(
        max_num_seqs=args.requests,
        # Room for every request at once, so the KV budget never queues or preempts anyone.
        num_blocks=math.ceil(args.requests * per_request * 1.25) + 1,
        max_num_batched_tokens=args.max_num_batched_tokens or defaults.max_num_batched_tokens,
        mixed_batches=not args.no_mixed,
        # Every run repeats the same prompts: a prefix cache would skip the timed runs' prefill.
        enable_prefix_caching=False,
    )


async def _async_run(engine: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    from services.worker.engine.async_engine import AsyncEngine

    async def consume(stream: Any) -> list[int]:
        return [token async for out in stream for token in out.new_token_ids]

    idle_stop, idle_lags = asyncio.Event(), list[float]()
    idle = asyncio.create_task(probe_event_loop(idle_stop, idle_lags))
    await asyncio.sleep(0.2)
    idle_stop.set()
    await idle
    # The engine was built on the main thread, which ran the other contestants: stepping it from the
    # facade's thread adds a second OpenMP team (see async_engine.py), so this rate is a lower bound.
    facade = AsyncEngine(lambda: engine)
    await facade.start()
    stop, lags = asyncio.Event(), list[float]()
    ticker = asyncio.create_task(probe_event_loop(stop, lags))
    started = time.perf_counter()
    streams = [facade.submit(f"bench-{i}", p, params) for i, p in enumerate(prompts)]
    outputs = await asyncio.gather(*(consume(s) for s in streams))
    elapsed = time.perf_counter() - started
    stop.set()
    await ticker
    await facade.stop()
    return {
        "outputs": list(outputs),
        "tok_s": sum(len(o) for o in outputs) / elapsed,
        **lag_summary(lags),
        "loop_lag_ms_idle_p50": lag_summary(idle_lags)["loop_lag_ms_p50"],
        "probe_ticks": len(lags),
    }


def measure_async(engine: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """One untimed-for-the-table run through the asyncio facade, probing the event loop's lag."""
    print("bench.engine: one run through the asyncio facade (event-loop lag)", file=sys.stderr, flush=True)
    return asyncio.run(_async_run(engine, prompts, params))


def without_native(run: Run) -> Run:
    """The same run with the native CPU kernels switched off for its duration."""
    from services.worker.model import native

    def wrapped() -> tuple[list[list[int]], float]:
        previous = native.set_enabled(False)
        try:
            return run()
        finally:
            native.set_enabled(previous)

    return wrapped


def engine_run(
    engine: Any,
    prompts: list[list[int]],
    params: Any,
    logs: list[list[tuple[int, int]]],
    full_decode_rates: list[float],
    cached_logs: list[list[int]] | None = None,
) -> Run:
    """A Run of `engine.generate` over the prompts; each run appends its step log to `logs`, its
    cached-token log to `cached_logs` when given, and its full-batch decode rate, if it had full-batch
    steps, to `full_decode_rates`."""

    def run() -> tuple[list[list[int]], float]:
        engine.reset_step_log()
        started = time.perf_counter()
        outputs: list[list[int]] = engine.generate(prompts, params)
        elapsed = time.perf_counter() - started
        logs.append(list(engine.step_log))
        if cached_logs is not None:
            cached_logs.append(list(engine.step_cached_tokens))
        # Steady state: the steps where every request decodes (the GPU floor's workload).
        full = [
            seconds
            for (tokens, logits), seconds in zip(engine.step_log, engine.step_seconds, strict=True)
            if tokens == logits == len(prompts)
        ]
        if full:
            full_decode_rates.append(len(prompts) * len(full) / sum(full))
        return outputs, elapsed

    return run
