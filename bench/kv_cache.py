"""`python -m bench.kv_cache` (`make bench-kv`): the int8 KV cache against the float32 one.

On `--model` (default SmolLM2-135M-Instruct), CPU, `--threads` threads, four parts, each from the
engine itself:
- capacity: the KV tokens LLMEngine sizes for each format at one kv_cache_memory_bytes (`--budget`);
- speed: `--streams` streams of `--prompt-tokens` random prompt tokens and `--new-tokens` greedy
  tokens (EOS ignored), and one stream of 64 + 64, through LLMEngine.generate with each cache (prefix
  caching off, so rounds cannot serve each other), the contestants alternated within each of
  `--rounds` rounds, prefill and decode timed apart (bench/peer_engine.py's phases); medians, min-max;
- quality: bench/kv_quality.py's perplexity and greedy agreement;
- headroom: at the budget that holds `--headroom-streams` float32 sequences of `--headroom-context`
  tokens, how many int8 sequences of that length run at once, and the engine's own preemption count:
  float32 at its count, int8 at the count that budget fits and at 4x the float32 count.
It writes bench/results/kv-cache-cpu.json with bench/provenance.py's block. It measures; the targets'
verdicts are the report's arithmetic on these figures (bench/kv_report.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench import kv_quality
from bench.kv_report import verdicts
from bench.model_parity import prompt_ids
from bench.peer_engine import phases
from bench.provenance import finish_provenance, start_provenance
from bench.stats import DEFAULT_MODEL, make_prompts, print_targets, save_record, summarize

FORMATS = ("float32", "int8")
GIB = 1 << 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_cache", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=int, default=4 * GIB, help="kv_cache_memory_bytes of both caches")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quality-tokens", type=int, default=64, help="greedy tokens per parity prompt")
    p.add_argument("--context", type=int, default=512, help="perplexity window")
    p.add_argument("--headroom-streams", type=int, default=64)
    p.add_argument("--headroom-context", type=int, default=256)
    p.add_argument("--json", type=Path, default=Path("bench/results/kv-cache-cpu.json"))
    args = p.parse_args(argv)
    if args.rounds < 5:
        p.error(f"--rounds {args.rounds}: ratios need at least 5 alternated rounds")
    return args


def engine(loaded: Any, cache_dtype: str, budget: int, max_num_seqs: int, max_model_len: int) -> Any:
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import LLMEngine

    config = EngineConfig(
        kv_cache_dtype=cache_dtype,
        kv_cache_memory_bytes=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
    )
    return LLMEngine(loaded, config)


def timed(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from strata.sampling import SamplingParams

    engine.reset_step_log()
    started = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - started
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "tok_s": len(prompts) * new_tokens / seconds,
        **phases(engine.step_log, engine.step_seconds, prompt_tokens),
    }


def speed(
    engines: dict[str, Any], shapes: list[tuple[int, int, int]], rounds: int, vocab: int
) -> dict[str, Any]:
    """Per shape (streams, prompt, new): each format's runs, alternated, the order flipped each round."""
    found: dict[str, Any] = {}
    for streams, prompt, new in shapes:
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in FORMATS}
        # One untimed run of each: the first step of a shape pays for allocations the rest reuse.
        warm = make_prompts(streams, prompt, vocab, set(), seed=10_000)
        for name in FORMATS:
            timed(engines[name], warm, min(new, 8))
        for index in range(rounds):
            prompts = make_prompts(streams, prompt, vocab, set(), seed=index)
            order = FORMATS if index % 2 == 0 else FORMATS[::-1]
            for name in order:
                runs[name].append(timed(engines[name], prompts, new))
            print(
                f"bench.kv_cache: {streams}x{prompt}+{new} round {index + 1}/{rounds}",
                file=sys.stderr,
                flush=True,
            )
        found[f"{streams}x{prompt}+{new}"] = {
            name: {key: asdict(summarize([r[key] for r in runs[name]])) for key in ("tok_s", "decode_tok_s")}
            | {"runs": runs[name]}
            for name in FORMATS
        }
    return found


def headroom(loaded: Any, streams: int, context: int) -> dict[str, Any]:
    """Peak running sequences and preemptions at the float32 budget of `streams` x `context` tokens."""
    from services.worker.model import kv_format
    from services.worker.model.kv_cache import KVCache
    from strata.sampling import SamplingParams

    block = 16
    per_block = KVCache.bytes_per_block(loaded.config, block, kv_format.plain(torch.float32))
    budget = streams * -(-context // block) * per_block
    fitting = budget // KVCache.bytes_per_block(
        loaded.config, block, kv_format.resolve("int8", loaded.dtype, "cpu")
    )
    int8_streams = int(fitting * block // context)
    found: dict[str, Any] = {"budget_bytes": budget, "int8_full_context_sequences_that_fit": int8_streams}
    prompt = 32
    for name, count in (("float32", streams), ("int8", int8_streams), ("int8", 4 * streams)):
        eng = engine(loaded, name, budget, count, context)
        params = SamplingParams(max_new_tokens=context - prompt, ignore_eos=True)
        prompts = make_prompts(count, prompt, loaded.config.vocab_size, set(), seed=1)
        for i, p in enumerate(prompts):
            eng.add_request(f"headroom-{i}", p, params)
        peak = 0
        while eng.has_work():
            eng.step()
            peak = max(peak, eng.stats().num_running)
        stats = eng.stats()
        found[f"{name}@{count}"] = {
            "sequences": count,
            "peak_running": peak,
            "preemptions": stats.num_preemptions,
            "kv_tokens": stats.total_kv_tokens,
        }
        print(
            f"bench.kv_cache: headroom {name} x{count}: {found[f'{name}@{count}']}",
            file=sys.stderr,
            flush=True,
        )
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from services.worker.model.loader import load_model

    provenance = start_provenance(threads=args.threads)
    loaded = load_model(args.model)
    vocab = loaded.config.vocab_size
    longest = args.prompt_tokens + args.new_tokens
    engines = {name: engine(loaded, name, args.budget, args.streams, max(longest, 512)) for name in FORMATS}
    capacity = {name: engines[name].memory.kv_tokens for name in FORMATS}
    print(f"bench.kv_cache: capacity {capacity}", file=sys.stderr, flush=True)
    shapes = [(args.streams, args.prompt_tokens, args.new_tokens), (1, 64, 64)]
    rates = speed(engines, shapes, args.rounds, vocab)
    quality = {
        "perplexity": kv_quality.perplexities(args.model, args.context, list(FORMATS)),
        "greedy": kv_quality.greedy_agreement(engines, prompt_ids(args.model), args.quality_tokens),
    }
    print(f"bench.kv_cache: quality {quality['perplexity']}", file=sys.stderr, flush=True)
    del engines
    room = headroom(loaded, args.headroom_streams, args.headroom_context)
    record: dict[str, Any] = {
        "benchmark": "kv-cache",
        "provenance": finish_provenance(provenance),
        "workload": {
            "model": str(args.model),
            "budget_bytes": args.budget,
            "shapes": [f"{s}x{p}+{n}" for s, p, n in shapes],
            "rounds": args.rounds,
            "threads": args.threads,
            "headroom_streams": args.headroom_streams,
            "headroom_context": args.headroom_context,
        },
        "capacity_kv_tokens": capacity,
        "speed": rates,
        "quality": quality,
        "headroom": room,
    }
    record["targets"] = verdicts(record)
    save_record(record, args.json)
    print_targets("bench.kv_cache", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
