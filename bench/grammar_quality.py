"""Structured output's quality on the real model: of `--prompts` requests (five schemas rotated over 20
topics), greedy, `--max-tokens` each, how many finish with stop rather than length, and whether every
finished output parses and validates against its schema with the `jsonschema` library.

The requests run together in the in-process engine, each with its schema's grammar, the prompt
asking for that schema's JSON (and showing the schema) through the model's chat template. The record
keeps per-schema counts, every output that failed, and the rate; it is valid when at least 95% finish
with stop and every finished output validates. This module must not be imported by the service.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

from bench.grammar_cost import chat_prompts, compiler_for
from bench.grammar_schemas import SCHEMAS
from bench.provenance import finish_provenance, start_provenance
from bench.stats import DEFAULT_MODEL, save_record
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.grammar_spec import GrammarSpec
from services.worker.engine.sequence import FinishReason
from strata.sampling import SamplingParams

TARGET_STOP_RATE = 0.95


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    provenance = start_provenance()
    config = EngineConfig(max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=1536 * 1024 * 1024)
    engine = LLMEngine.from_model_dir(args.model, config)
    compiler = compiler_for(engine, args.model)
    prompts = chat_prompts(args.model, args.prompts)
    tokenizer = compiler.tokenizer
    ids = []
    started = time.perf_counter()
    for i, (name, prompt) in enumerate(prompts):
        grammar = compiler.matcher(GrammarSpec.of("json_schema", json.dumps(SCHEMAS[name])))
        rid = f"q{i}"
        engine.add_request(rid, prompt, SamplingParams(max_new_tokens=args.max_tokens), grammar=grammar)
        ids.append(rid)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, FinishReason | None] = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    wall = time.perf_counter() - started
    per_schema: dict[str, dict[str, int]] = {n: {"requests": 0, "stop": 0, "valid": 0} for n in SCHEMAS}
    failures: list[dict[str, Any]] = []
    for rid, (name, _) in zip(ids, prompts, strict=True):
        counts = per_schema[name]
        counts["requests"] += 1
        text = tokenizer.decode_str(tokens[rid])
        if reasons[rid] is not FinishReason.STOP:
            failures.append({"id": rid, "schema": name, "finish": str(reasons[rid]), "text": text})
            continue
        counts["stop"] += 1
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append(
                {"id": rid, "schema": name, "finish": "stop", "error": str(exc)[:200], "text": text}
            )
            continue
        counts["valid"] += 1
    stopped = sum(c["stop"] for c in per_schema.values())
    valid = sum(c["valid"] for c in per_schema.values())
    record: dict[str, Any] = {
        "benchmark": "grammar-quality",
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "stop_rate": stopped / args.prompts,
        "finished_valid_rate": valid / stopped if stopped else 0.0,
        "per_schema": per_schema,
        "output_tokens": sum(len(t) for t in tokens.values()),
        "wall_s": wall,
        "failures": failures,
        "samples": {name: tokenizer.decode_str(tokens[ids[i]]) for i, name in enumerate(SCHEMAS)},
        "provenance": finish_provenance(provenance),
    }
    record["valid"] = record["stop_rate"] >= TARGET_STOP_RATE and valid == stopped
    print(
        f"stop {stopped}/{args.prompts} ({record['stop_rate']:.0%}), finished and valid {valid}/{stopped}, "
        f"{record['output_tokens']} tokens in {wall:.0f} s"
    )
    for name, counts in per_schema.items():
        print(f"  {name:10s} stop {counts['stop']}/{counts['requests']} valid {counts['valid']}")
    save_record(record, args.json)
    return 0 if record["valid"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
