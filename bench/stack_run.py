"""What `strata bench` does once its options are parsed: rounds of stack sweeps and engine baselines.

Each round runs the whole concurrency sweep against the stack, then, when asked, the in-process
engine on the same token ids while the stack sits idle (A B A B A B, bench/README.md's rule 7). The
first round starts with an untimed warm-up of both. The rounds' figures are reduced to a median and
a min-max per level, the stack is judged against the engine, and the record, the plots and a table
come out. This module orchestrates; the streams are bench/load.py's (each request bench/driver.py's),
the stack, channel and publishing bench/session.py's, the prompts bench/stack_prompts.py, the engine
bench/stack_engine.py, the reduction, verdict and record bench/stack_report.py, the plots
bench/plots.py. It must not import bench/stack.py (the command line imports it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.driver import make_request
from bench.load import LevelRun, run_level, summarize_level
from bench.options import requests_per_level
from bench.provenance import start_provenance
from bench.session import BenchError, gateway, publish, stack_endpoints
from bench.stack_prompts import Prompt, build_prompts, load_tokenizer
from bench.stack_report import aggregate_levels, build_record, engine_record, format_report, judge
from strata.settings import DEFAULT_CONFIG, SettingsError
from strata.v1 import gateway_pb2

if TYPE_CHECKING:
    import argparse

    from services.worker.settings import WorkerSettings


@dataclass(frozen=True, slots=True)
class Round:
    """One round's prompts: a list per concurrency level, each prompt distinct across the whole run."""

    index: int
    levels: dict[int, list[Prompt]]


def _worker_settings(args: argparse.Namespace) -> WorkerSettings:
    from services.worker.settings import WorkerSettings

    config = args.config or DEFAULT_CONFIG
    try:
        settings = WorkerSettings.load(config, index=0)
    except SettingsError as exc:
        raise BenchError(f"{exc}\n(the model folder and the engine baseline come from --config)") from exc
    if args.model_dir is not None:
        settings = settings.model_copy(update={"model_path": args.model_dir.resolve()})
    return settings


async def _sweep(
    address: str, args: argparse.Namespace, plan: Round, warmup: list[Prompt]
) -> tuple[list[LevelRun], LevelRun | None, gateway_pb2.ListModelsResponse]:
    """One round against the stack: the warm-up if any, then every level in increasing concurrency."""
    async with gateway(address) as (stub, models):
        warm = None
        if warmup:
            requests = [
                make_request(p, args.new_tokens, f"bench-warmup-{i}", args.model)
                for i, p in enumerate(warmup)
            ]
            warm = await run_level(
                stub,
                requests,
                len(requests),
                timeout_s=args.timeout,
                label="warm-up",
                progress=not args.no_progress,
            )
        runs = []
        for concurrency, prompts in plan.levels.items():
            tag = f"bench-r{plan.index}-c{concurrency}"
            requests = [
                make_request(p, args.new_tokens, f"{tag}-{i}", args.model) for i, p in enumerate(prompts)
            ]
            label = f"run {plan.index + 1}/{args.runs} c={concurrency}"
            runs.append(
                await run_level(
                    stub,
                    requests,
                    concurrency,
                    timeout_s=args.timeout,
                    label=label,
                    progress=not args.no_progress,
                )
            )
        return runs, warm, models


def _plan(args: argparse.Namespace, tokenizer: Any) -> tuple[list[Prompt], list[Round]]:
    seed = f"{args.seed}/{args.prompt_tokens}"
    warmup = build_prompts(tokenizer, args.warmup_requests, args.prompt_tokens, f"{seed}/warmup")
    rounds = [
        Round(
            index,
            {
                n: build_prompts(
                    tokenizer, requests_per_level(args, n), args.prompt_tokens, f"{seed}/r{index}/c{n}"
                )
                for n in args.concurrency
            },
        )
        for index in range(args.runs)
    ]
    return warmup, rounds


def run_benchmark(args: argparse.Namespace) -> int:
    """Every round, then the record, the plots and the table; 1 when errors void the numbers."""
    from bench.plots import write_plots
    from bench.stack_engine import EngineBaseline, resolve_device

    settings = _worker_settings(args)
    model_dir = Path(settings.model_path)
    try:
        tokenizer = load_tokenizer(model_dir)
    except FileNotFoundError as exc:
        raise BenchError(str(exc)) from exc
    warmup, rounds = _plan(args, tokenizer)
    top, lowest = max(args.concurrency), min(args.concurrency)
    device, _ = resolve_device(settings)
    threads = args.threads or settings.threads
    engine = EngineBaseline(settings, threads) if args.engine_baseline else None
    # After the engine set its threads: the record shows them (the worker's, or the engine's when set).
    provenance = start_provenance(threads=threads, device=device)

    summaries: list[list[dict[str, Any]]] = []
    warm_summary: dict[str, Any] | None = None
    engine_tok_s: list[float] = []
    engine_ttft: list[list[float]] = []
    identical = compared = 0
    models = gateway_pb2.ListModelsResponse()
    # A closed loop of `top` streams measures serving: every route admits all of them at once.
    with stack_endpoints(args, admit=top) as endpoints:
        address = endpoints.gateway
        if engine is not None and warmup:
            # The stack is idle until the first sweep: the engine's warm-up runs now.
            engine.throughput([list(p.token_ids) for p in warmup], args.new_tokens, top)
            engine.time_to_first_token([list(warmup[0].token_ids)], args.new_tokens)
        for plan in rounds:
            runs, warm, models = asyncio.run(_sweep(address, args, plan, warmup if plan.index == 0 else []))
            if warm is not None:
                warm_summary = summarize_level(warm, [len(p.token_ids) for p in warmup], args.new_tokens)
            summaries.append(
                [
                    summarize_level(
                        run, [len(p.token_ids) for p in plan.levels[run.concurrency]], args.new_tokens
                    )
                    for run in runs
                ]
            )
            if engine is None:
                continue
            # The stack is idle now: its sweep has finished, so the two never share the cores.
            prompts = [list(p.token_ids) for p in plan.levels[top]]
            result = engine.throughput(prompts, args.new_tokens, top)
            engine_tok_s.append(result.tok_s)
            stack_tokens = {r.index: r.token_ids for r in runs[-1].results if r.status == "OK"}
            compared += len(stack_tokens)
            identical += sum(stack_tokens[i] == result.outputs[i] for i in stack_tokens)
            alone = [list(p.token_ids) for p in plan.levels[lowest][: args.ttft_requests]]
            engine_ttft.append(engine.time_to_first_token(alone, args.new_tokens))

    levels = aggregate_levels(summaries)
    record = build_record(
        args,
        address=address,
        provenance=provenance,
        models=models,
        model_dir=model_dir,
        levels=levels,
        warmup=warm_summary,
        requests_per_level={n: len(prompts) for n, prompts in rounds[0].levels.items()},
    )
    if engine is not None:
        level = (top, len(rounds[0].levels[top]))
        baseline = engine_record(engine.describe(), level, engine_tok_s, engine_ttft, identical, compared)
        record["engine_baseline"] = baseline
        record["target"] = judge(levels, baseline)
    return publish(record, args, format_report(record), write_plots)
