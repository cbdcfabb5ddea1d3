"""The asyncio facade's cost: the engine stepped on the facade's thread against the engine stepped on
the main thread, and the event-loop lag the step thread's GIL holding causes.

Each contestant runs in a fresh process, so that only one thread of it ever runs torch (two threads
running torch make two OpenMP teams, which on a 2-core machine turns off libgomp's spin-waiting and
costs 13-25%: see async_engine.py). The processes alternate, sync facade sync facade ..., which is
this benchmark's form of bench/README.md's rule 7. Each one warms up, then times one run.

    python -m bench.facade --requests 64 --prompt-tokens 64 --new-tokens 64 --json FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from bench.provenance import finish_provenance, start_provenance
from bench.stats import (
    add_workload_arguments,
    lag_summary,
    make_prompts,
    probe_event_loop,
    save_record,
    summarize,
)


def _workload(args: argparse.Namespace) -> tuple[Any, list[list[int]], Any]:
    import torch

    from services.worker.engine.config import EngineConfig
    from strata.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.requests, args.prompt_tokens, 40000, set(range(100)), seed=0)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    return EngineConfig(max_num_seqs=args.requests), prompts, params


def _sync_run(args: argparse.Namespace) -> dict[str, float]:
    from services.worker.engine.engine import LLMEngine
    from strata.sampling import SamplingParams

    config, prompts, params = _workload(args)
    engine = LLMEngine.from_model_dir(args.model, config)
    engine.generate(prompts[:4], SamplingParams(max_new_tokens=4, ignore_eos=True))
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    return {"tok_s": sum(map(len, outputs)) / (time.perf_counter() - started)}


async def _facade_run(args: argparse.Namespace) -> dict[str, float]:
    from services.worker.engine.async_engine import AsyncEngine
    from services.worker.engine.engine import LLMEngine
    from strata.sampling import SamplingParams

    config, prompts, params = _workload(args)
    facade = AsyncEngine(lambda: LLMEngine.from_model_dir(args.model, config))
    await facade.start()

    async def consume(tag: str, prompt: list[int], p: Any) -> int:
        return sum([len(out.new_token_ids) async for out in facade.submit(tag, prompt, p)])

    warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
    await asyncio.gather(*(consume(f"warm-{i}", p, warm) for i, p in enumerate(prompts[:4])))
    lags: list[float] = []
    done = asyncio.Event()
    ticker = asyncio.create_task(probe_event_loop(done, lags))
    started = time.perf_counter()
    counts = await asyncio.gather(*(consume(f"r{i}", p, params) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - started
    done.set()
    await ticker
    await facade.stop()
    return {"tok_s": sum(counts) / elapsed, **lag_summary(lags)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_arguments(parser)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", choices=["sync", "facade"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one == "sync":
        print(json.dumps(_sync_run(args)))
        return 0
    if args.one == "facade":
        print(json.dumps(asyncio.run(_facade_run(args))))
        return 0
    passthrough = [
        *("--model", str(args.model), "--requests", str(args.requests), "--threads", str(args.threads)),
        *("--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)),
    ]
    provenance = start_provenance(threads=args.threads)
    runs: dict[str, list[dict[str, float]]] = {"sync": [], "facade": []}
    for _ in range(args.runs):
        for mode, results in runs.items():
            command = [sys.executable, "-m", "bench.facade", *passthrough, "--one", mode]
            result = subprocess.run(command, check=True, capture_output=True, text=True)
            results.append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(f"  {mode}: {results[-1]}", file=sys.stderr, flush=True)
    record: dict[str, Any] = {
        "provenance": finish_provenance(provenance),
        "runs": args.runs,
        "threads": args.threads,
    }
    for mode, results in runs.items():
        record[mode] = {key: asdict(summarize([r[key] for r in results])) for key in results[0]}
    record["facade_vs_sync"] = record["facade"]["tok_s"]["median"] / record["sync"]["tok_s"]["median"]
    print(json.dumps({k: record[k] for k in ("sync", "facade", "facade_vs_sync")}, indent=2))
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
