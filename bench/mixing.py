"""Mixed steps (decodes plus prefill chunks) against alternating steps (prefill-only, decode-only).

The scheduler can do either (`EngineConfig.mixed_batches`). This measures both on one workload in
one process, alternated, per bench/README.md's rules: throughput, and time to first token and
inter-token latency, since the choice trades one against the other. Requests arrive in two waves so
that prefills of the second wave meet decodes of the first, which is where the modes differ.

    python -m bench.mixing --requests 64 --prompt-tokens 64 --new-tokens 64 --json FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.baselines import special_token_ids
from bench.provenance import finish_provenance, start_provenance
from bench.stats import add_workload_arguments, make_prompts, save_record, summarize
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model.loader import load_model
from strata.sampling import SamplingParams


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    half = len(prompts) // 2
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    started = time.perf_counter()
    for index, prompt in enumerate(prompts[:half]):
        engine.add_request(f"a{index}", prompt, params)
        arrival[f"a{index}"] = started
    steps = 0
    while engine.has_work() or steps == 0:
        if steps == 4:  # the second wave lands while the first decodes
            now = time.perf_counter()
            for index, prompt in enumerate(prompts[half:]):
                engine.add_request(f"b{index}", prompt, params)
                arrival[f"b{index}"] = now
        steps += 1
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id not in first:
                first[out.request_id] = now
            else:
                gaps.append(now - last[out.request_id])
            last[out.request_id] = now
    elapsed = time.perf_counter() - started
    ttft = [first[rid] - arrival[rid] for rid in arrival]
    return {
        "tok_s": len(prompts) * params.max_new_tokens / elapsed,
        "ttft_p50_ms": statistics.median(ttft) * 1000,
        "ttft_max_ms": max(ttft) * 1000,
        "itl_p50_ms": statistics.median(gaps) * 1000,
        "itl_p99_ms": sorted(gaps)[int(0.99 * (len(gaps) - 1))] * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_arguments(parser)
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig().max_num_batched_tokens)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    provenance = start_provenance()
    loaded = load_model(args.model)
    vocab = loaded.config.vocab_size
    excluded = special_token_ids(args.model, vocab, None)
    prompts = make_prompts(args.requests, args.prompt_tokens, vocab, excluded, seed=0)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    # Two engines share this process: each gets the blocks its workload holds at most, since one sized
    # from the machine's memory would leave the other none.
    block = EngineConfig().block_size
    blocks = args.requests * -(-(args.prompt_tokens + args.new_tokens) // block) + 1
    engines = {
        mode: LLMEngine(
            loaded,
            EngineConfig(
                max_num_seqs=args.requests,
                max_num_batched_tokens=args.max_num_batched_tokens,
                mixed_batches=mode == "mixed",
                num_blocks=blocks,
            ),
        )
        for mode in ("mixed", "alternating")
    }
    for engine in engines.values():
        _run(engine, prompts[:4], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in engines}
    for _ in range(args.runs):
        for mode, engine in engines.items():
            runs[mode].append(_run(engine, prompts, params))
    record: dict[str, Any] = {
        "provenance": finish_provenance(provenance),
        "runs": args.runs,
        "workload": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    for mode, results in runs.items():
        record[mode] = {key: asdict(summarize([r[key] for r in results])) for key in results[0]}
    print(json.dumps({mode: record[mode] for mode in engines}, indent=2))
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
