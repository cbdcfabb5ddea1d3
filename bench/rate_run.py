"""What `strata bench --rate` does once its options are parsed: the open loop at each offered rate,
fallback off and on.

Against a running stack (`--address`) or one started here (`--spawn`), aiming at the primary route,
its fallback and its SLO as bench/rate_target.py reads them. After an untimed warm-up of both
routes, `--rate auto` measures the primary's capacity and offers `--rate-factor` (2) times it; a
fixed list (`--rate 14,28`) offers each of its rates in turn, in the order given, with no capacity
run. Per rate, `--runs` rounds of two phases on that rate's arrival schedule, OFF ON OFF ON OFF ON
(bench/README.md's rule 7); between phases every answer is in, the gateway's queues read empty, and
the stack idles `--gap` seconds. Just before and after each phase the gateway's /metrics is scraped,
when its address is known, for its admission decision histogram. The schedule is bench/rate.py's
(each request bench/driver.py's), the stack, channel and publishing bench/session.py's, the scrape
bench/gateway_metrics.py's, the reduction bench/rate_phase.py's, the verdict and record
bench/rate_report.py's, the plot bench/plots.py's; this module only orchestrates. It must not import
bench/stack.py (the command line imports it) nor the closed loop's run (bench/stack_run.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from bench.gateway_metrics import bucket_delta, scrape_decisions
from bench.provenance import git_checkout
from bench.rate import (
    arrival_offsets,
    arrivals_per_phase,
    drain,
    measure_capacity,
    rate_request,
    run_phase,
    warm_up,
)
from bench.rate_phase import PHASES, aggregate_phase, summarize_phase
from bench.rate_report import build_rate_record, format_rate_report, rate_entry
from bench.rate_target import prepare
from bench.session import BenchError, gateway, publish, stack_endpoints
from bench.stack_prompts import build_prompts

if TYPE_CHECKING:
    import argparse

    from tokenizers import Tokenizer

    from bench.driver import Stub
    from bench.gateway_metrics import Buckets
    from bench.rate_target import Target
    from bench.session import Endpoints


async def _scrape(address: str | None) -> dict[str, Buckets] | None:
    """The gateway's decision histogram now; None when its metrics address is unknown."""
    if address is None:
        return None
    try:
        return await scrape_decisions(address)
    except (OSError, ValueError) as exc:  # urllib's errors are OSErrors; a page the parser cannot read
        raise BenchError(
            f"the gateway's metrics at http://{address}/metrics could not be read: {exc}"
        ) from exc


async def _phase(
    stub: Stub,
    args: argparse.Namespace,
    target: Target,
    tokenizer: Tokenizer,
    offsets: list[float],
    *,
    rate: tuple[int, float],
    round_index: int,
    name: str,
    metrics: str | None,
) -> dict[str, Any]:
    """One phase of one round at one rate, its prompts distinct from every other phase's."""
    rate_index, rps = rate
    seed = f"{args.seed}/{args.prompt_tokens}/{rps:g}/r{round_index}/{name}"
    prompts = build_prompts(tokenizer, len(offsets), args.prompt_tokens, seed)
    requests = [
        rate_request(
            p, args.new_tokens, f"bench-{rate_index}-r{round_index}-{name}-{i}", target.primary,
            fallback=name == "on",
        )
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    label = f"{rps:g}/s run {round_index + 1}/{args.runs} fallback {name}"
    before = await _scrape(metrics)
    results, wall = await run_phase(
        stub, requests, offsets, timeout_s=args.timeout, label=label, progress=not args.no_progress
    )
    after = await _scrape(metrics)
    try:
        decisions = bucket_delta(before, after) if before is not None and after is not None else None
    except ValueError as exc:
        raise BenchError(f"{label}: {exc} (did the gateway restart?)") from exc
    summary = summarize_phase(
        results, phase=name, wall_s=wall, input_tokens=[len(p.token_ids) for p in prompts],
        new_tokens=args.new_tokens, slo_ms=target.slo_ms, primary=target.primary, decisions=decisions,
    )  # fmt: skip
    await drain(stub, args.gap)
    return summary


async def _offered_rates(
    stub: Stub, args: argparse.Namespace, target: Target, tokenizer: Tokenizer
) -> tuple[dict[str, Any] | None, list[tuple[float, str]]]:
    """The capacity run's record (auto only) and each rate to offer with where it came from."""
    if args.rate != "auto":
        return None, [(float(rate), "--rate") for rate in args.rate]
    worker = target.worker
    concurrency = args.capacity_concurrency or (worker.engine.max_num_seqs if worker else 16)
    count = args.capacity_requests or 2 * concurrency
    prompts = build_prompts(
        tokenizer, count, args.prompt_tokens, f"{args.seed}/{args.prompt_tokens}/capacity"
    )
    capacity = await measure_capacity(stub, args, prompts, target.primary, concurrency)
    if capacity["requests_per_s"] <= 0:
        raise BenchError(f"the primary completed no request in the capacity run: {capacity}")
    capacity["factor"] = args.rate_factor
    await drain(stub, args.gap)
    return capacity, [
        (args.rate_factor * capacity["requests_per_s"], f"auto: {args.rate_factor:g} x capacity")
    ]


def _workload(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    """What every rate shares: the requests, the schedule's shape, the phases' order and the SLO."""
    return {
        "model": target.primary,
        "fallback_model": target.fallback,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "arrival": args.arrival,
        "seed": args.seed,
        "runs": args.runs,
        "phase_order": [name for _ in range(args.runs) for name in PHASES],
        "gap_s": args.gap,
        "ttft_slo_ms": target.slo_ms,
        "ttft_slo_source": target.slo_source,
        "priority": "interactive",
        "fallback_flags": {"off": "no_fallback=true, allow_fallback=false", "on": "allow_fallback=true"},
        "loop": "open: requests leave on the schedule whatever the stack answers",
        "sampling": "greedy, ignore_eos: every request generates exactly new_tokens",
    }


async def _session(endpoints: Endpoints, args: argparse.Namespace) -> dict[str, Any]:
    """Everything against the stack: routes, warm-up, capacity, then each rate's alternating phases."""
    async with gateway(endpoints.gateway) as (stub, models):
        target, tokenizer, provenance = prepare(args, models)
        # A metrics address that does not answer fails here, before any load.
        await _scrape(endpoints.gateway_metrics)
        warm = build_prompts(
            tokenizer, args.warmup_requests, args.prompt_tokens, f"{args.seed}/{args.prompt_tokens}/warmup"
        )
        await warm_up(stub, args, warm, [target.primary, *([target.fallback] if target.fallback else [])])
        capacity, offered = await _offered_rates(stub, args, target, tokenizer)
        rates = []
        for rate_index, (rps, source) in enumerate(offered):
            count = arrivals_per_phase(rps, args.duration, args.arrivals)
            offsets = arrival_offsets(rps, count, args.arrival, f"{args.seed}/arrivals")
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in PHASES}
            for round_index in range(args.runs):
                for name in PHASES:
                    runs[name].append(
                        await _phase(
                            stub, args, target, tokenizer, offsets, rate=(rate_index, rps),
                            round_index=round_index, name=name, metrics=endpoints.gateway_metrics,
                        )
                    )  # fmt: skip
            phases = {name: aggregate_phase(phase_runs) for name, phase_runs in runs.items()}
            rates.append(
                rate_entry(
                    rate_rps=rps, rate_source=source, offsets=offsets, phases=phases, slo_ms=target.slo_ms
                )
            )
        stack = {
            "address": endpoints.gateway,
            "gateway_metrics": endpoints.gateway_metrics,
            "spawned": args.spawn,
            "default_model": models.default_model,
            "models": [
                {"name": m.name, "fallback_model": m.fallback_model, "ready_workers": m.ready_workers}
                for m in models.models
            ],
            "model_dir": str(target.model_dir),
        }
        return {
            "rates": rates,
            "capacity": capacity,
            "provenance": provenance,
            "workload": _workload(args, target),
            "stack": stack,
        }


def _checkout() -> dict[str, Any]:
    """The checkout this code runs from: its commit (None outside git) and whether it was dirty."""
    tree = Path(__file__).resolve().parents[1]
    commit, dirty = git_checkout(tree)
    return {"tree": str(tree), "commit": commit or None, "dirty": dirty if commit else None}


def run_rate_benchmark(args: argparse.Namespace) -> int:
    """The open-loop run, then the record, the plot and the table; 1 when errors void the numbers."""
    from bench.plots import write_rate_plot

    checkout = _checkout()  # at the start: what ran, even if the tree changes meanwhile
    with stack_endpoints(args) as endpoints:
        try:
            measured = asyncio.run(_session(endpoints, args))
        except grpc.aio.AioRpcError as exc:
            raise BenchError(
                f"the gateway failed a ListModels call: {exc.code().name}: {exc.details()}"
            ) from exc
        except TimeoutError as exc:
            raise BenchError(str(exc)) from exc
    record = build_rate_record(
        args, checkout=checkout, stack=measured["stack"], provenance=measured["provenance"],
        workload=measured["workload"], capacity=measured["capacity"], rates=measured["rates"],
    )  # fmt: skip
    return publish(record, args, format_rate_report(record), write_rate_plot)
