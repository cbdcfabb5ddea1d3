"""What `strata bench --rate` aims at, read from the gateway's routes and the stack config.

ListModels names the primary route (`--model`, else the gateway's default) and its fallback; the
config (`--config`, else configs/local.yaml) gives the primary's worker (its tokenizer folder, its
max_num_seqs for the capacity run, its threads) and the route's TTFT SLO (`--ttft-slo-ms` overrides
it). This module only reads; it must not talk to the stack beyond the answer it is handed, nor run
any load (bench/rate_run.py does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench.session import BenchError
from strata.settings import DEFAULT_CONFIG, SettingsError, read_config

if TYPE_CHECKING:
    import argparse
    from pathlib import Path

    from tokenizers import Tokenizer

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


def resolve_target(args: argparse.Namespace, models: gateway_pb2.ListModelsResponse) -> Target:
    """The primary and its fallback from ListModels, the worker, model folder and SLO from the config."""
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


def worker_threads(args: argparse.Namespace, target: Target) -> dict[str, int | None]:
    """Each route's torch threads as configured (None: torch's default), for the machine record."""
    threads = {target.primary: target.worker.threads if target.worker else None}
    if target.fallback:
        worker = primary_worker(args.config or DEFAULT_CONFIG, target.fallback)
        threads[target.fallback] = worker.threads if worker else None
    return threads


def prepare(
    args: argparse.Namespace, models: gateway_pb2.ListModelsResponse
) -> tuple[Target, Tokenizer, dict[str, Any]]:
    """The run's target, its tokenizer, and the provenance, the machine with each route's torch threads."""
    from bench.provenance import start_provenance
    from bench.stack_engine import resolve_device
    from bench.stack_prompts import load_tokenizer

    target = resolve_target(args, models)
    try:
        tokenizer = load_tokenizer(target.model_dir)
    except FileNotFoundError as exc:
        raise BenchError(str(exc)) from exc
    threads = worker_threads(args, target)
    device = resolve_device(target.worker)[0] if target.worker else "unknown"
    provenance = start_provenance(threads=threads[target.primary], device=device)
    provenance["machine"]["worker_threads"] = threads
    return target, tokenizer, provenance
