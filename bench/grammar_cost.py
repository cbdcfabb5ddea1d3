"""What structured output costs the engine: tokens/s at N streams with a JSON schema on every request
against the same requests unconstrained, the mask's share of a step, and cold compile times.

Both contestants run the real model in the in-process engine (the layer that pays for the mask),
greedy, every request `--new-tokens` long: the constrained ones ask for an array of exactly
`--items` objects of one of bench/grammar_schemas.py's five schemas (rotated), which no request can
finish within the token budget, so both make exactly streams x new-tokens tokens and the ratio
compares equal work. Contestants alternate run by run (free, json, free, json, ...), after one
warm-up each. The record holds both rates per run, the ratio of medians, the mask's seconds per
step (GrammarMasker.stats), the unconstrained path's hook cost, and each schema's cold compile
(a new compiler, so nothing is cached; its tokenizer's one-off setup is recorded apart).

This module must not be imported by the service: it is a program that writes one JSON record.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.grammar_schemas import PROMPTS, SCHEMAS, TOPICS
from bench.provenance import finish_provenance, start_provenance
from bench.stats import DEFAULT_MODEL, save_record, summarize
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.grammar_compiler import GrammarCompiler
from services.worker.engine.grammar_spec import GrammarSpec
from strata.sampling import SamplingParams


def chat_prompts(model_dir: Path, count: int) -> list[tuple[str, list[int]]]:
    """(schema name, prompt ids) rotated over the five schemas and 20 topics, via the chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    names = list(SCHEMAS)
    out = []
    for i in range(count):
        name = names[i % len(names)]
        question = PROMPTS[name].format(topic=TOPICS[(i // len(names)) % len(TOPICS)])
        text = f"{question}\nAnswer with JSON that follows this schema: {json.dumps(SCHEMAS[name])}"
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out.append((name, list(tokenizer(chat, add_special_tokens=False)["input_ids"])))
    return out


def compiler_for(engine: LLMEngine, model_dir: Path) -> GrammarCompiler:
    config = engine.model_config
    return GrammarCompiler.from_model_dir(model_dir, config.eos_token_ids, config.vocab_size, timeout_s=60.0)


def _long_spec(name: str, items: int) -> GrammarSpec:
    schema = {"type": "array", "items": SCHEMAS[name], "minItems": items, "maxItems": items}
    return GrammarSpec.of("json_schema", json.dumps(schema))


def _run(engine: LLMEngine, prompts, compiler, new_tokens: int, items: int) -> dict[str, float]:
    grammars = None
    if compiler is not None:
        grammars = [compiler.matcher(_long_spec(name, items)) for name, _ in prompts]
    masker = engine.runner.masker
    mask_before = (masker.stats.seconds, masker.stats.steps) if masker is not None else (0.0, 0)
    engine.reset_step_log()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = engine.generate([ids for _, ids in prompts], params, grammars)
    wall = time.perf_counter() - started
    tokens = sum(len(o) for o in outputs)
    if tokens != len(prompts) * new_tokens:
        raise RuntimeError(f"{tokens} tokens for {len(prompts)} x {new_tokens}: a request ended early")
    masker = engine.runner.masker
    mask_s = masker.stats.seconds - mask_before[0] if masker is not None else 0.0
    mask_steps = masker.stats.steps - mask_before[1] if masker is not None else 0
    return {
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "steps": len(engine.step_seconds),
        "step_s": sum(engine.step_seconds),
        "mask_s": mask_s,
        "mask_steps": mask_steps,
    }


def _hook_cost_us(engine: LLMEngine, prompts) -> float:
    """The unconstrained path's whole price: the runner's check for grammar rows, per 64-row step."""
    from services.worker.engine.sequence import ScheduledBatch, ScheduledEntry, Sequence

    seqs = [Sequence(f"h{i}", ids, SamplingParams()) for i, (_, ids) in enumerate(prompts)]
    batch = ScheduledBatch(0, [ScheduledEntry(s, 0, 1, [1], True) for s in seqs])
    logits = torch.zeros(len(seqs), 8)
    reps = 2000
    started = time.perf_counter()
    for _ in range(reps):
        engine.runner._mask_grammars(logits, batch)
    return (time.perf_counter() - started) / reps * 1e6


def _overlap_probe(engine: LLMEngine, prompts, compiler, steps: int = 12) -> dict[str, float]:
    """Where the mask should run: a decode step alone, the 64 rows' mask fill alone, both one after the
    other, and the fill on a thread while the step runs (the library releases the GIL)."""
    import threading

    from llguidance.torch import fill_next_token_bitmask_par

    from bench.grammar_schemas import sample_text

    masker = engine.runner.masker
    if masker is None:
        raise RuntimeError("run the constrained contestant first")
    matchers: list[tuple[Any, int]] = []
    for name, _ in prompts:
        grammar = compiler.matcher(GrammarSpec.of("json_schema", json.dumps(SCHEMAS[name])))
        doc = compiler.tokenizer.tokenize_str(sample_text(name))
        grammar.replay(doc[: len(doc) // 2])  # mid-document: a typical mask, not the first one
        matchers.append((grammar.raw, len(matchers)))
    bitmask = torch.zeros((len(matchers), (compiler.vocab_size + 31) // 32), dtype=torch.int32)
    params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)
    for i, (_, ids) in enumerate(prompts):
        engine.add_request(f"probe-{i}", ids, params)
    while engine.scheduler.waiting or any(s.num_new_tokens_to_compute > 1 for s in engine.scheduler.running):
        engine.step()
    alone, fill, overlapped = [], [], []
    for _ in range(steps // 2):
        started = time.perf_counter()
        engine.step()
        alone.append(time.perf_counter() - started)
        started = time.perf_counter()
        fill_next_token_bitmask_par(masker.executor, matchers, bitmask)
        fill.append(time.perf_counter() - started)
        thread = threading.Thread(
            target=fill_next_token_bitmask_par, args=(masker.executor, matchers, bitmask)
        )
        started = time.perf_counter()
        thread.start()
        engine.step()
        thread.join()
        overlapped.append(time.perf_counter() - started)
    while engine.has_work():
        engine.step()
    step, mask, both = (summarize(v).median * 1e3 for v in (alone, fill, overlapped))
    return {"step_ms": step, "mask_ms": mask, "serial_ms": step + mask, "overlapped_ms": both}


def _cold_compiles(engine: LLMEngine, model_dir: Path) -> tuple[float, dict[str, float]]:
    started = time.perf_counter()
    compiler = compiler_for(engine, model_dir)
    setup = time.perf_counter() - started
    times = {}
    for name, schema in SCHEMAS.items():
        started = time.perf_counter()
        compiler.matcher(GrammarSpec.of("json_schema", json.dumps(schema)))
        times[name] = (time.perf_counter() - started) * 1e3
    compiler.close()
    return setup, times


def spread(values: list[float]) -> dict[str, float]:
    s = summarize(values)
    return {"median": s.median, "low": s.low, "high": s.high}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--items", type=int, default=12, help="objects per constrained answer")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    provenance = start_provenance()
    # Room for every stream's whole sequence: no preemption in either contestant.
    config = EngineConfig(
        max_num_seqs=args.streams, max_num_batched_tokens=2048, kv_cache_memory_bytes=1024 * 1024 * 1024
    )
    engine = LLMEngine.from_model_dir(args.model, config)
    compiler = compiler_for(engine, args.model)
    prompts = chat_prompts(args.model, args.streams)
    runs: dict[str, list[dict[str, float]]] = {"free": [], "json_schema": []}
    for contestant in runs:  # warm-up, not recorded
        _run(engine, prompts, compiler if contestant == "json_schema" else None, args.new_tokens, args.items)
    for _ in range(args.runs):
        for contestant, done in runs.items():
            use = compiler if contestant == "json_schema" else None
            done.append(_run(engine, prompts, use, args.new_tokens, args.items))
            print(f"{contestant:12s} {done[-1]['tokens_per_s']:.1f} tok/s")
    rates = {c: summarize([r["tokens_per_s"] for r in rs]) for c, rs in runs.items()}
    cold = [_cold_compiles(engine, args.model) for _ in range(args.runs)]
    json_runs = runs["json_schema"]
    record: dict[str, Any] = {
        "benchmark": "grammar-cost",
        "streams": args.streams,
        "new_tokens": args.new_tokens,
        "items": args.items,
        "runs": runs,
        "tokens_per_s": {c: spread([r["tokens_per_s"] for r in rs]) for c, rs in runs.items()},
        "json_over_free": rates["json_schema"].median / rates["free"].median,
        "json_over_free_per_run": [
            j["tokens_per_s"] / f["tokens_per_s"] for f, j in zip(runs["free"], json_runs, strict=True)
        ],
        "mask_ms_per_step": spread([r["mask_s"] / max(1, r["mask_steps"]) * 1e3 for r in json_runs]),
        "mask_share_of_step_time": spread([r["mask_s"] / r["step_s"] for r in json_runs]),
        "unconstrained_hook_us_per_step": _hook_cost_us(engine, prompts),
        "mask_placement_ms": _overlap_probe(engine, prompts, compiler),
        "cold_compile": {
            "tokenizer_setup_s": summarize([setup for setup, _ in cold]).median,
            "per_schema_ms": {n: spread([t[n] for _, t in cold]) for n in SCHEMAS},
        },
        "provenance": finish_provenance(provenance),
    }
    record["valid"] = args.runs >= 3
    print(
        f"json/free {record['json_over_free']:.3f}  mask {record['mask_ms_per_step']['median']:.2f} ms/step "
        f"({record['mask_share_of_step_time']['median']:.1%} of step time)  "
        f"hook {record['unconstrained_hook_us_per_step']:.1f} us"
    )
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
