"""`python -m bench.memory_soak`: does a worker's memory stay flat while it serves?

The engine is built as a worker builds it (the KV cache sized from `--memory-utilization` of the
memory this process may use, after the profiling step), then serves waves of requests of mixed
prompt and output lengths, a share of them aborted half-way, for `--seconds`. The process's resident
memory (CPU) or torch's allocated bytes (CUDA) is read after the first wave (the warm-up) and after
every later one; the record gives each reading, the largest growth over the warm-up value and
whether it stayed within `--bound` (5%). It drives the engine in this process, without gRPC: what
it measures is the engine's memory (cache, gathers, sampler, sequences), the part that grows with
traffic. This module only measures; it must not change the engine's behaviour.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.provenance import finish_provenance, start_provenance
from bench.stats import save_record
from services.worker.device_memory import device_memory_bytes
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from strata.sampling import SamplingParams

MIB = 2**20


def wave(engine: LLMEngine, rng: random.Random, size: int, index: int, abort_share: float) -> int:
    """Run `size` requests to completion (some aborted half-way); return the tokens generated."""
    vocab = engine.model_config.vocab_size
    plans = {}
    for number in range(size):
        longest = min(768, engine.max_model_len // 2)
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(8, longest))]
        new = rng.randint(4, min(96, engine.max_model_len - len(prompt)))
        request_id = f"soak-{index}-{number}"
        params = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=rng.choice((0.0, 0.8)))
        engine.validate(prompt, params)
        engine.add_request(request_id, prompt, params)
        plans[request_id] = new // 2 if rng.random() < abort_share else None
    generated: dict[str, int] = dict.fromkeys(plans, 0)
    pending = set(plans)
    while pending:
        for out in engine.step():
            generated[out.request_id] += len(out.new_token_ids)
            stop_at = plans[out.request_id]
            if out.finished:
                pending.discard(out.request_id)
            elif stop_at is not None and generated[out.request_id] >= stop_at:
                engine.abort(out.request_id)
                pending.discard(out.request_id)
    return sum(generated.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--memory-utilization", type=float, default=0.3)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--wave", type=int, default=32, help="requests per wave")
    parser.add_argument("--seconds", type=float, default=180.0, help="how long the waves after warm-up run")
    parser.add_argument("--abort-share", type=float, default=0.2)
    parser.add_argument("--bound", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    provenance = start_provenance(device=args.device)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, memory_utilization=args.memory_utilization)
    started = time.monotonic()
    engine = LLMEngine.from_model_dir(args.model, config, device=args.device)
    built_s = time.monotonic() - started
    print(f"built in {built_s:.1f} s: {engine.memory.describe()}", flush=True)
    rng = random.Random(args.seed)
    tokens = wave(engine, rng, args.wave, 0, args.abort_share)
    warm = device_memory_bytes(args.device)
    print(f"warm-up wave done at {time.monotonic() - started:.1f} s: {warm / MIB:.1f} MiB", flush=True)
    readings: list[dict[str, Any]] = []
    soak_started = time.monotonic()
    index = 0
    while time.monotonic() - soak_started < args.seconds:
        index += 1
        tokens += wave(engine, rng, args.wave, index, args.abort_share)
        now = device_memory_bytes(args.device)
        readings.append({"wave": index, "s": round(time.monotonic() - soak_started, 1), "bytes": now})
        print(f"wave {index:3}: {now / MIB:8.1f} MiB ({(now - warm) / warm:+.2%} over warm-up)", flush=True)
    growth = max((r["bytes"] - warm) / warm for r in readings) if readings else 0.0
    record = {
        "benchmark": "memory_soak",
        "provenance": finish_provenance(provenance),
        "model": str(args.model),
        "engine": config.model_dump(),
        "budget": engine.memory.parts() | {"kv_tokens": engine.memory.kv_tokens},
        "budget_log": engine.memory.describe(),
        "build_s": round(built_s, 2),
        "waves": index,
        "requests": (index + 1) * args.wave,
        "tokens_generated": tokens,
        "soak_s": round(time.monotonic() - soak_started, 1),
        "after_warm_up_bytes": warm,
        "readings": readings,
        "largest_growth": round(growth, 4),
        "bound": args.bound,
        "within_bound": growth <= args.bound,
    }
    save_record(record, args.json)
    print(f"largest growth over warm-up: {growth:+.2%} (bound {args.bound:.0%})")
    return 0 if growth <= args.bound else 1


if __name__ == "__main__":
    raise SystemExit(main())
