"""What `strata bench --rate` does once its options are parsed: the open-loop run, fallback off and on.

Against a running stack (`--address`) or one started here (`--spawn`): ListModels names the primary
route (`--model`, else the default) and its fallback; the config gives the primary worker (tokenizer,
max_num_seqs) and the route's TTFT SLO. After an untimed warm-up of both routes, `--rate auto`
measures the primary's capacity and offers `--rate-factor` (2) times it. Then `--runs` rounds of two
phases on the same arrival schedule, OFF ON OFF ON OFF ON (bench/README.md's rule 7); between phases
every answer is in, the gateway's queues read empty, and the stack idles `--gap` seconds. The
schedule is bench/rate.py's (each request bench/driver.py's), the stack, channel and publishing
bench/session.py's, the reduction, verdict and record bench/rate_report.py, the plot bench/plots.py;
this module only orchestrates and reads the config. It must not import bench/stack.py (the command
line imports it) nor the closed loop's run (bench/stack_run.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from bench.rate import (
    arrival_offsets,
    arrivals_per_phase,
    drain,
    measure_capacity,
    rate_request,
    run_phase,
    warm_up,
)
from bench.rate_report import PHASES, aggregate_phase, build_rate_record, format_rate_report, summarize_phase
from bench.session import BenchError, gateway, publish, stack_address
from bench.stack_prompts import build_prompts, load_tokenizer
from bench.stats import describe_machine
from strata.settings import DEFAULT_CONFIG, SettingsError, read_config

if TYPE_CHECKING:
    import argparse
    from pathlib import Path

    from tokenizers import Tokenizer

    from bench.driver import Stub
    from services.worker.settings import WorkerSettings
    from strata.v1 import gateway_pb2

DEFAULT_SLO_MS = 2000.0


def primary_worker(config: Path, model: str) -> WorkerSettings | None:
    """The config's worker serving `model`; None when the config has none (a stack started elsewhere)."""
    from services.worker.settings import WorkerSettings

    workers = read_config(config).get("workers")
    for index in range(len(workers) if isinstance(workers, list) else 0):
        settings = WorkerSettings.load(config, index=index)
        if settings.model_name == model:
            return settings
    return None


def route_slo_ms(config: Path, model: str) -> tuple[float, str]:
    """The route's ttft_slo_ms from the config's gateway routes, else the settings' default, else 2000.

    A route whose SLO check is off (0) has no SLO to measure against: strata bench's default serves.
    """
    section = read_config(config).get("gateway")
    routes = section.get("routes") if isinstance(section, dict) else None
    for route in routes if isinstance(routes, list) else []:
        if isinstance(route, dict) and route.get("model") == model and "ttft_slo_ms" in route:
            if float(route["ttft_slo_ms"]) > 0:
                return float(route["ttft_slo_ms"]), f"{config}: gateway.routes[{model}].ttft_slo_ms"
            return DEFAULT_SLO_MS, f"strata bench's default ({config}: the route's SLO check is off)"
    from gateway.settings import RouteSettings

    field = RouteSettings.model_fields.get("ttft_slo_ms")
    if field is not None and isinstance(field.default, (int, float)) and field.default > 0:
        return float(field.default), "the gateway's RouteSettings.ttft_slo_ms default"
    return DEFAULT_SLO_MS, "strata bench's default"


@dataclass(frozen=True, slots=True)
class Target:
    """What the run aims at: the primary route, its fallback, its worker's settings and the SLO."""

    primary: str
    fallback: str
    worker: WorkerSettings | None
    model_dir: Path
    slo_ms: float
    slo_source: str


def _target(args: argparse.Namespace, models: gateway_pb2.ListModelsResponse) -> Target:
    config = args.config or DEFAULT_CONFIG
    primary = args.model or models.default_model
    info = next((m for m in models.models if m.name == primary), None)
    try:
        worker = primary_worker(config, primary)
        slo = (args.ttft_slo_ms, "--ttft-slo-ms") if args.ttft_slo_ms else route_slo_ms(config, primary)
    except SettingsError as exc:
        raise BenchError(f"{exc}\n(the model folder and the SLO come from --config)") from exc
    model_dir = args.model_dir or (worker.model_path if worker is not None else None)
    if model_dir is None:
        raise BenchError(f"{config} has no worker for model {primary!r}: pass --model-dir or --config")
    fallback = info.fallback_model if info is not None else ""
    return Target(primary, fallback, worker, model_dir, slo[0], slo[1])


def _worker_threads(args: argparse.Namespace, target: Target) -> dict[str, int | None]:
    """Each route's torch threads as configured (None: torch's default), for the machine record."""
    threads = {target.primary: target.worker.threads if target.worker else None}
    if target.fallback:
        worker = primary_worker(args.config or DEFAULT_CONFIG, target.fallback)
        threads[target.fallback] = worker.threads if worker else None
    return threads


async def _phases(
    stub: Stub, args: argparse.Namespace, target: Target, tokenizer: Tokenizer, offsets: list[float]
) -> dict[str, dict[str, Any]]:
    """The rounds, OFF then ON each, on the same schedule; distinct prompts per phase; drained between."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in PHASES}
    seed = f"{args.seed}/{args.prompt_tokens}"
    for index in range(args.runs):
        for name in PHASES:
            prompts = build_prompts(tokenizer, len(offsets), args.prompt_tokens, f"{seed}/r{index}/{name}")
            requests = [
                rate_request(
                    p, args.new_tokens, f"bench-r{index}-{name}-{i}", target.primary, fallback=name == "on"
                )
                for i, p in enumerate(prompts)
            ]
            label = f"run {index + 1}/{args.runs} fallback {name}"
            results, wall = await run_phase(
                stub, requests, offsets, timeout_s=args.timeout, label=label, progress=not args.no_progress
            )
            summary = summarize_phase(
                results, phase=name, wall_s=wall, input_tokens=[len(p.token_ids) for p in prompts],
                new_tokens=args.new_tokens, slo_ms=target.slo_ms, primary=target.primary,
            )  # fmt: skip
            runs[name].append(summary)
            await drain(stub, args.gap)
    return {name: aggregate_phase(phase_runs) for name, phase_runs in runs.items()}


def _workload(
    args: argparse.Namespace, target: Target, rate: tuple[float, str], offsets: list[float]
) -> dict[str, Any]:
    return {
        "model": target.primary,
        "fallback_model": target.fallback,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "rate_rps": rate[0],
        "rate_source": rate[1],
        "arrival": args.arrival,
        "seed": args.seed,
        "arrivals_per_phase": len(offsets),
        "schedule_s": offsets[-1],
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


async def _session(address: str, args: argparse.Namespace) -> dict[str, Any]:
    """Everything against the stack: routes, warm-up, capacity, then the alternating phases."""
    from bench.stack_engine import resolve_device

    async with gateway(address) as (stub, models):
        target = _target(args, models)
        try:
            tokenizer = load_tokenizer(target.model_dir)
        except FileNotFoundError as exc:
            raise BenchError(str(exc)) from exc
        machine = describe_machine(resolve_device(target.worker)[0] if target.worker else "unknown")
        machine["worker_threads"] = _worker_threads(args, target)
        seed = f"{args.seed}/{args.prompt_tokens}"
        warm = build_prompts(tokenizer, args.warmup_requests, args.prompt_tokens, f"{seed}/warmup")
        await warm_up(stub, args, warm, [target.primary, *([target.fallback] if target.fallback else [])])

        capacity = None
        rate = (float(args.rate), "--rate") if args.rate != "auto" else (0.0, "")
        if args.rate == "auto":
            worker = target.worker
            concurrency = args.capacity_concurrency or (worker.engine.max_num_seqs if worker else 16)
            prompts = build_prompts(
                tokenizer, args.capacity_requests or 2 * concurrency, args.prompt_tokens, f"{seed}/capacity"
            )
            capacity = await measure_capacity(stub, args, prompts, target.primary, concurrency)
            if capacity["requests_per_s"] <= 0:
                raise BenchError(f"the primary completed no request in the capacity run: {capacity}")
            capacity["factor"] = args.rate_factor
            rate = (args.rate_factor * capacity["requests_per_s"], f"auto: {args.rate_factor:g} x capacity")
            await drain(stub, args.gap)
        count = arrivals_per_phase(rate[0], args.duration, args.arrivals)
        offsets = arrival_offsets(rate[0], count, args.arrival, f"{args.seed}/arrivals")
        phases = await _phases(stub, args, target, tokenizer, offsets)
        stack = {
            "address": address,
            "spawned": args.spawn,
            "default_model": models.default_model,
            "models": [
                {"name": m.name, "fallback_model": m.fallback_model, "ready_workers": m.ready_workers}
                for m in models.models
            ],
            "model_dir": str(target.model_dir),
        }
        return {
            "phases": phases,
            "capacity": capacity,
            "machine": machine,
            "workload": _workload(args, target, rate, offsets),
            "stack": stack,
        }


def run_rate_benchmark(args: argparse.Namespace) -> int:
    """The open-loop run, then the record, the plot and the table; 1 when errors void the numbers."""
    from bench.plots import write_rate_plot

    with stack_address(args) as address:
        try:
            measured = asyncio.run(_session(address, args))
        except grpc.aio.AioRpcError as exc:
            raise BenchError(
                f"the gateway failed a ListModels call: {exc.code().name}: {exc.details()}"
            ) from exc
        except TimeoutError as exc:
            raise BenchError(str(exc)) from exc
    record = build_rate_record(
        args, stack=measured["stack"], machine=measured["machine"], workload=measured["workload"],
        capacity=measured["capacity"], phases=measured["phases"],
    )  # fmt: skip
    return publish(record, args, format_rate_report(record), write_rate_plot)
