"""`python -m bench.engine`: our engine against transformers and against the matmul ceiling.

Contestants, on the same seeded prompts: naive transformers `generate` one request at a time,
transformers continuous batching, and our in-process engine; then the linear-layer ceiling of the
engine's own schedule. Every contestant's outputs pass the parity rule before its times count, runs
alternate within one process, and the result is a table plus a JSON record (bench/README.md has the
rules). This module orchestrates and reports; the transformers contestants live in
bench/baselines.py, our engine's in bench/engine_contestant.py, the ceiling in bench/ceiling.py.
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.baselines import (
    DTYPES,
    HfContinuousBatching,
    NaiveGenerate,
    build_random_model,
    load_hf_model,
    special_token_ids,
)
from bench.ceiling import CeilingResult, linear_ceiling, nominal_step_log
from bench.engine_contestant import Run, engine_config_for, engine_run, measure_async, without_native
from bench.engine_options import parse_args
from bench.physical_limit import ModelBytes, measure_machine, physical_limit
from bench.provenance import finish_provenance, start_provenance
from bench.stats import (
    check_parity,
    format_table,
    make_prompts,
    rates_record,
    save_record,
)

if TYPE_CHECKING:
    import argparse


def _resolve_model(args: argparse.Namespace, scratch: Path) -> Path:
    if args.random_weights:
        return build_random_model(args.random_weights, scratch / args.random_weights, DTYPES[args.dtype])
    if not (args.model / "config.json").exists():
        sys.exit(f"bench.engine: no model at {args.model}: run `make model` (or pass --random-weights)")
    return Path(args.model)


def _rounds(contestants: dict[str, Run], runs: int) -> dict[str, list[tuple[list[list[int]], float]]]:
    """A B C A B C ...: each round runs every contestant once, so drift hits them all alike."""
    results: dict[str, list[tuple[list[list[int]], float]]] = {name: [] for name in contestants}
    for round_index in range(runs):
        for name, run in contestants.items():
            outputs, seconds = run()
            results[name].append((outputs, seconds))
            print(f"  run {round_index + 1}/{runs} {name}: {seconds:.2f} s", file=sys.stderr, flush=True)
    return results


def run_benchmark(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    # generate_batch warns on every persistent-manager call, through its own logger.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    provenance = start_provenance(device=args.device)
    dtype = DTYPES[args.dtype]
    model_dir = _resolve_model(args, scratch)
    hf_model = load_hf_model(model_dir, args.device, dtype)
    vocab = hf_model.config.vocab_size
    prompts = make_prompts(
        args.requests,
        args.prompt_tokens,
        vocab,
        special_token_ids(model_dir, vocab, args.random_weights),
        args.seed,
    )
    naive_prompts, checked = prompts[: args.naive_requests], prompts[: args.check_requests]
    engine_config = engine_config_for(args)
    # hf_cb gets the engine's per-step token budget: same prefill chunking for both batchers.
    budget = engine_config.max_num_batched_tokens

    naive = NaiveGenerate(hf_model, args.new_tokens)
    contestants: dict[str, Run] = {"naive": lambda: naive.run(naive_prompts)}
    hf_cb = None
    if not args.no_hf_cb:
        hf_cb = HfContinuousBatching(hf_model, args.requests, args.prompt_tokens, args.new_tokens, budget)
        contestants["hf_cb"] = lambda: hf_cb.run(prompts)
    engine, engine_logs = None, list[list[tuple[int, int]]]()
    engine_cached_logs: list[list[int]] = []
    full_decode_rates: list[float] = []
    torch_ops_decode_rates: list[float] = []
    if not args.skip_engine:
        from services.worker.engine.engine import LLMEngine
        from strata.sampling import SamplingParams

        engine = LLMEngine.from_model_dir(model_dir, config=engine_config, device=args.device, dtype=dtype)
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        contestants["engine"] = engine_run(
            engine, prompts, params, engine_logs, full_decode_rates, engine_cached_logs
        )
        if args.compare_native:
            contestants["engine_torch_ops"] = without_native(
                engine_run(engine, prompts, params, [], torch_ops_decode_rates)
            )
    quantized_decode_rates: list[float] = []
    if args.quantization and not args.skip_engine:
        quantized = LLMEngine.from_model_dir(
            model_dir, config=engine_config, device=args.device, dtype=dtype, quantization=args.quantization
        )
        contestants["quantized"] = engine_run(quantized, prompts, params, [], quantized_decode_rates)

    print(f"bench.engine: greedy reference on {len(checked)} requests", file=sys.stderr, flush=True)
    reference = naive.reference(checked, args.reference_batch)
    print("bench.engine: warm-up and parity check of every contestant", file=sys.stderr, flush=True)
    parity = {name: check_parity(run()[0], reference, args.tie_gap) for name, run in contestants.items()}
    # The warm-up's schedule with the cached tokens each step attended to: the physical limit's input.
    cached_tokens = engine_cached_logs[0] if engine_cached_logs else []

    # The ceiling replays the warm-up's engine schedule, and takes its turn in every round.
    schedule = (
        engine_logs[0]
        if engine is not None
        else nominal_step_log(args.requests, args.prompt_tokens, args.new_tokens, budget)
    )
    ceiling_model = engine.runner.model if engine is not None else hf_model
    ceilings: list[CeilingResult] = []

    def run_ceiling() -> tuple[list[list[int]], float]:
        ceilings.append(linear_ceiling(ceiling_model, schedule, args.ceiling_reps))
        return [], ceilings[-1].seconds

    results = _rounds({**contestants, "ceiling": run_ceiling}, args.runs)
    limit = _physical_limit(args, engine, schedule, cached_tokens)
    for name in contestants:
        for outputs, _ in results[name]:
            parity[name].merge(check_parity(outputs, reference, args.tie_gap))
    async_result = None
    if engine is not None and not args.no_asyncio:
        async_result = measure_async(engine, prompts, params)
        parity["engine_asyncio"] = check_parity(async_result.pop("outputs"), reference, args.tie_gap)
    if hf_cb is not None:
        hf_cb.close()

    generated = {name: len(prompts) * args.new_tokens for name in results}
    generated["naive"] = len(naive_prompts) * args.new_tokens
    record = rates_record(
        {name: [generated[name] / seconds for _, seconds in runs] for name, runs in results.items()}
    )
    parity_ok = all(report.ok for name, report in parity.items() if name != "quantized")
    record.update(
        {
            "valid": parity_ok and not args.smoke,
            "smoke": args.smoke,
            "physical_limit_tok_s": (
                len(prompts) * args.new_tokens / limit["seconds"] if limit is not None else None
            ),
            "physical_limit": limit,
            "ceiling_schedule": "engine step log" if engine is not None else "nominal (no engine)",
            "ceiling_weights": "engine model (fused qkv, gate_up)" if engine is not None else "transformers",
            "ceiling_layer_seconds_by_m": ceilings[-1].layer_seconds_by_m,
            "ceiling_lm_head_seconds_by_m": ceilings[-1].lm_head_seconds_by_m,
            "engine_steps": len(schedule) if engine is not None else 0,
            "engine_full_batch_decode_tok_s": (
                statistics.median(full_decode_rates) if full_decode_rates else None
            ),
            "engine_torch_ops_full_batch_decode_tok_s": (
                statistics.median(torch_ops_decode_rates) if torch_ops_decode_rates else None
            ),
            "quantization": args.quantization,
            "quantized_full_batch_decode_tok_s": (
                statistics.median(quantized_decode_rates) if quantized_decode_rates else None
            ),
            "engine_step_log": [list(step) for step in schedule] if engine is not None else [],
            "engine_schedule_stable": all(log == schedule for log in engine_logs),
            "engine_asyncio": async_result,
            "hf_cb_all_admitted_at_once": hf_cb.all_admitted_at_once if hf_cb is not None else None,
            "parity": {
                "rule": "tests/parity.py: identical greedy tokens, or a first divergence at a reference "
                "top-2 gap under the tie gap where ours is the runner-up",
                "tie_gap": args.tie_gap,
                "reference": f"transformers generate (greedy, use_cache, EOS an ordinary token) on "
                f"{len(checked)} requests, {args.reference_batch} equal-length prompts per call",
                "random_weights": bool(args.random_weights),
                "ok": parity_ok,
                "exempt": ["quantized"] if args.quantization else [],
                **{name: report.as_dict() for name, report in parity.items()},
            },
            "provenance": finish_provenance(provenance),
            "config": {
                **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "model_dir": str(model_dir) if not args.random_weights else f"random {args.random_weights}",
                "engine_config": None if args.skip_engine else engine_config.model_dump(),
                "hf_cb_config": hf_cb.describe() if hf_cb is not None else None,
            },
        }
    )
    return record


def _physical_limit(
    args: argparse.Namespace, engine: Any, schedule: list[tuple[int, int]], cached_tokens: list[int]
) -> dict[str, Any] | None:
    """Bytes over bandwidth and FLOPs over matmul throughput for the engine's schedule (CPU only)."""
    if engine is None or args.device != "cpu":
        return None
    element = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    steps = [(t, n, cached) for (t, n), cached in zip(schedule, cached_tokens, strict=True)]
    return physical_limit(ModelBytes.of(engine.model_config, element), measure_machine(), steps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="strata-bench-") as scratch:
        record = run_benchmark(args, Path(scratch))
    save_record(record, args.json)
    print(format_table(record))
    if "quantized_tok_s" in record:
        low, high = record["quantized_spread"]
        print(
            f"{'quantized':<10} {record['quantized_tok_s']:>10.1f} {f'{low:.1f}-{high:.1f}':>22}  "
            f"{record['quantization']}: {record['quantized_tok_s'] / record['engine_tok_s']:.2f}x the engine"
        )
    if args.json is not None:
        print(f"wrote {args.json}")
    if not record["parity"]["ok"]:
        print(
            "bench.engine: PARITY FAILED: these times do not count (see parity in the JSON)", file=sys.stderr
        )
        return 1
    if record["smoke"]:
        print("bench.engine: --smoke run: not a valid result", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
