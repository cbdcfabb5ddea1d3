"""What `python -m bench.tenants` does once its options are parsed: the capacity run, then fair
queuing on and off alternated, each round of each on a freshly started stack.

Two copies of the config (bench/config_copy.py) set the gateway's `tenants` (bench/tenant_load.py's
two) and `fair_queuing` (true, false); every stack comes from one of them, its gateway on a free port
(bench/session.py's `spawned`). First, on a stack of the FIFO copy with the routes' TTFT SLO check
off (a closed loop's burst measures the worker, not admission), after an untimed warm-up, each
tenant's request shape gets its capacity measured as `strata bench --rate auto` does (bench/rate.py's
closed loop at the primary's max_num_seqs, no_fallback, with the tenant's key): completed
requests/s. Each tenant's schedule and requests are then built from it, once: the same in every
phase. Rounds run ON OFF ON OFF ON OFF (bench/README.md's rule 7): each phase starts a stack, warms
it up, drains its queues, idles `--gap`, sends both tenants' schedules at once (bench/rate.py's open
loop, one per tenant), and stops the stack once every answer is in. The reduction is
bench/tenant_phase.py's, the verdict and record bench/tenant_report.py's, the plot bench/plots.py's;
this module only orchestrates. It must not import bench/tenants.py (the command line imports it).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from bench.config_copy import write_config
from bench.load import run_level
from bench.provenance import git_checkout
from bench.rate import drain, measure_capacity, run_phase
from bench.rate_target import prepare
from bench.session import BenchError, gateway, publish, spawned
from bench.stack_prompts import build_prompts
from bench.tenant_load import (
    TENANTS,
    build_load,
    build_requests,
    gateway_overrides,
    rates_record,
    shapes,
    tenant_metadata,
    tenants_record,
)
from bench.tenant_phase import aggregate_contestant, summarize_round, summarize_tenant
from bench.tenant_report import CONTESTANTS, build_record, format_report
from strata.settings import DEFAULT_CONFIG, read_config

if TYPE_CHECKING:
    import argparse

    from tokenizers import Tokenizer

    from bench.driver import Stub
    from bench.rate_target import Target
    from bench.session import Endpoints
    from bench.tenant_load import TenantLoad
    from strata.v1 import gateway_pb2

FAIR_QUEUING = {"on": True, "off": False}
# ListModels (the gateway check and the drain) carries a key too, where the gateway wants one.
LIST_METADATA = tenant_metadata("quiet")


@dataclass(frozen=True, slots=True)
class Setup:
    """What the capacity run's stack told: the target, the tokenizer, the provenance, each shape's
    capacity, the stack's routes, and each tenant's warm-up requests for every later stack."""

    target: Target
    tokenizer: Tokenizer
    provenance: dict[str, Any]
    capacity: dict[str, Any]
    stack: dict[str, Any]
    warm_up: dict[str, list[gateway_pb2.GenerateRequest]]


async def _warm_up(
    stub: Stub, args: argparse.Namespace, requests: dict[str, list[gateway_pb2.GenerateRequest]]
) -> None:
    """Untimed: each tenant's warm-up requests at once, with its key, one tenant after the other."""
    for tenant, batch in requests.items():
        if batch:
            await run_level(
                stub, batch, len(batch), timeout_s=args.timeout, label="warm-up", progress=False,
                metadata=tenant_metadata(tenant),
            )  # fmt: skip


async def _capacity(endpoints: Endpoints, args: argparse.Namespace) -> Setup:
    """The target, tokenizer, provenance and routes, and each shape's capacity, on the FIFO copy's stack."""
    async with gateway(endpoints.gateway, LIST_METADATA) as (stub, models):
        target, tokenizer, provenance = prepare(args, models)
        worker = target.worker
        concurrency = args.capacity_concurrency or (worker.engine.max_num_seqs if worker else 16)
        count = args.capacity_requests or 2 * concurrency
        warm_up = {
            t: build_requests(tokenizer, args, target.primary, t, args.warmup_requests, "warmup")
            for t in TENANTS
        }
        await _warm_up(stub, args, warm_up)
        measured: dict[str, Any] = {}
        for tenant, (tokens, _) in shapes(args).items():
            prompts = build_prompts(tokenizer, count, tokens, f"{args.seed}/{tenant}/{tokens}/capacity")
            metadata = tenant_metadata(tenant)
            shape = await measure_capacity(stub, args, prompts, target.primary, concurrency, metadata)
            if shape["requests_per_s"] <= 0:
                raise BenchError(
                    f"the primary completed no {tokens}-token request in the capacity run: {shape}"
                )
            measured[tenant] = {"prompt_tokens": tokens, **shape}
            await drain(stub, args.gap, LIST_METADATA)
        stack = {
            "default_model": models.default_model,
            "models": [
                {"name": m.name, "fallback_model": m.fallback_model, "ready_workers": m.ready_workers}
                for m in models.models
            ],
            "model_dir": str(target.model_dir),
        }
    capacity = {"fair_queuing": False, "concurrency": concurrency, "shapes": measured}
    return Setup(target, tokenizer, provenance, capacity, stack, warm_up)


async def _phase(
    endpoints: Endpoints, args: argparse.Namespace, setup: Setup, loads: list[TenantLoad], label: str
) -> tuple[dict[str, dict[str, Any]], float]:
    """Warm up, drain, idle, then every tenant's schedule at once: each tenant's summary, the wall time."""
    target = setup.target
    async with gateway(endpoints.gateway, LIST_METADATA) as (stub, _):
        await _warm_up(stub, args, setup.warm_up)
        await drain(stub, args.gap, LIST_METADATA)
        progress = not args.no_progress
        sends = [
            run_phase(
                stub, load.requests, load.offsets, timeout_s=args.timeout, label=f"{label}: {load.name}",
                progress=progress, metadata=load.metadata,
            )
            for load in loads
        ]  # fmt: skip
        started = time.perf_counter()
        outcomes = await asyncio.gather(*sends)
        wall = time.perf_counter() - started
    tenants = {}
    for load, (results, _) in zip(loads, outcomes, strict=True):
        tenants[load.name] = summarize_tenant(
            results, prompt_tokens=load.prompt_tokens, new_tokens=args.new_tokens, wall_s=wall,
            slo_ms=target.slo_ms, primary=target.primary,
        )  # fmt: skip
    return tenants, wall


def _workload(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    """What every phase shares: the requests, the schedules' shape, the phases' order and the SLO."""
    return {
        "model": target.primary,
        "fallback_model": target.fallback,
        "new_tokens": args.new_tokens,
        "tenants": tenants_record(args),
        "arrival": "poisson",
        "seed": args.seed,
        "duration_s": args.duration,
        "runs": args.runs,
        "phase_order": [name for _ in range(args.runs) for name in CONTESTANTS],
        "gap_s": args.gap,
        "ttft_slo_ms": target.slo_ms,
        "ttft_slo_source": target.slo_source,
        "priority": "interactive",
        "fallback_flags": "no_fallback=true, allow_fallback=false: the primary alone serves",
        "loop": "open: requests leave on each tenant's schedule whatever the stack answers",
        "sampling": "greedy, ignore_eos: every request generates exactly new_tokens",
    }


def _checkout() -> dict[str, Any]:
    """The checkout this code runs from: its commit (None outside git) and whether it was dirty."""
    tree = Path(__file__).resolve().parents[1]
    commit, dirty = git_checkout(tree)
    return {"tree": str(tree), "commit": commit or None, "dirty": dirty if commit else None}


def _run(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    """The capacity stack, then every round of both contestants: what the record is built from."""
    source = args.config or DEFAULT_CONFIG
    configs = {
        name: write_config(source, work_dir, f"fair-queuing-{name}", {"gateway": gateway_overrides(fair)})
        for name, fair in FAIR_QUEUING.items()
    }
    # The capacity run measures the worker, not admission: its closed loop sends a burst that the TTFT
    # SLO check would mostly refuse, so that stack's routes run without one.
    routes = read_config(source).get("gateway", {}).get("routes", [])
    unchecked = [{**route, "ttft_slo_ms": 0} for route in routes if isinstance(route, dict)]
    capacity = write_config(
        source, work_dir, "capacity", {"gateway": {**gateway_overrides(False), "routes": unchecked}}
    )
    with spawned(capacity, work_dir / "capacity-logs") as endpoints:
        setup = asyncio.run(_capacity(endpoints, args))
    # Built while no stack runs: the same schedules and prompts for every phase.
    loads = [
        build_load(
            setup.tokenizer, args, setup.target.primary, t, setup.capacity["shapes"][t]["requests_per_s"]
        )
        for t in TENANTS
    ]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTESTANTS}
    phases = []
    for round_index in range(args.runs):
        for name in CONTESTANTS:
            label = f"round {round_index + 1}/{args.runs} fair queuing {name}"
            log_dir = work_dir / f"round{round_index + 1}-{name}-logs"
            with spawned(configs[name], log_dir) as endpoints:
                tenants, wall = asyncio.run(_phase(endpoints, args, setup, loads, label))
            runs[name].append(summarize_round(tenants, contestant=name, round_index=round_index, wall_s=wall))
            phases.append(
                {"contestant": name, "round": round_index + 1, "fair_queuing": FAIR_QUEUING[name],
                 "config": str(configs[name]), "log_dir": str(log_dir), "wall_s": wall}
            )  # fmt: skip
    contestants = {
        name: {**aggregate_contestant(runs[name]), "gateway": gateway_overrides(FAIR_QUEUING[name])}
        for name in CONTESTANTS
    }
    return {
        "provenance": setup.provenance,
        "workload": _workload(args, setup.target),
        "capacity": setup.capacity,
        "stack": setup.stack,
        "rates": rates_record(args, loads, setup.capacity),
        "phases": phases,
        "contestants": contestants,
    }


def run_tenant_benchmark(args: argparse.Namespace) -> int:
    """The capacity run and the alternated contestants, then the record, the plot and the table."""
    from bench.plots import write_tenant_plot

    checkout = _checkout()  # at the start: what ran, even if the tree changes meanwhile
    work_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="strata-bench-tenants-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    print(f"bench.tenants: configs and service logs in {work_dir}", file=sys.stderr, flush=True)
    try:
        measured = _run(args, work_dir)
    except grpc.aio.AioRpcError as exc:
        raise BenchError(f"the gateway failed a ListModels call: {exc.code().name}: {exc.details()}") from exc
    except TimeoutError as exc:
        raise BenchError(str(exc)) from exc
    record = build_record(args, checkout=checkout, **measured)
    return publish(record, args, format_report(record), write_tenant_plot)
