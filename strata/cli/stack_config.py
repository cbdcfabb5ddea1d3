"""What the launcher reads from a stack's config file: each worker's settings and the environment its
process needs, and the gateway's routes to the workers it starts.

`routes_json` turns the config's `gateway.routes` options and the started workers' addresses into
STRATA_GATEWAY_ROUTES. This module must not start processes (launcher.py does).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from strata.settings import SettingsError, read_config

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path

    from services.worker.settings import WorkerSettings


def worker_settings(config_path: Path) -> list[WorkerSettings]:
    """Each worker's settings in the config, in index order (environment applied)."""
    from services.worker.settings import WorkerSettings

    workers = read_config(config_path).get("workers")
    if not isinstance(workers, list) or not workers:
        raise SettingsError(f"{config_path}: section 'workers' must list at least one worker")
    return [WorkerSettings.load(config_path, index=i) for i in range(len(workers))]


def model_paths(config_path: Path) -> list[Path]:
    """Every model folder the config's workers and tokenizer read (paths resolved, environment applied)."""
    from services.tokenizer.settings import TokenizerSettings

    paths = [settings.model_path for settings in worker_settings(config_path)]
    paths += list(TokenizerSettings.load(config_path).models.values())
    return list(dict.fromkeys(paths))


def worker_env(settings: WorkerSettings) -> dict[str, str]:
    """What a worker's process must find in its environment before torch loads."""
    if settings.omp_wait_policy is None:
        return {}
    return {"OMP_WAIT_POLICY": settings.omp_wait_policy}


def route_options(config_path: Path) -> list[dict[str, Any]]:
    """The config's `gateway.routes` entries, each a mapping with a `model` (per-route options)."""
    gateway = read_config(config_path).get("gateway") or {}
    entries = gateway.get("routes", []) if isinstance(gateway, dict) else []
    if not isinstance(entries, list) or not all(
        isinstance(entry, dict) and isinstance(entry.get("model"), str) for entry in entries
    ):
        raise SettingsError(
            f"{config_path}: gateway.routes must list mappings that each name a model, e.g. "
            "[{model: smollm2-135m-instruct, fallback: smollm2-135m-instruct-int8}]"
        )
    return [dict(entry) for entry in entries]


def check_route_options(
    models: Sequence[str], options: Sequence[Mapping[str, Any]]
) -> dict[str, Mapping[str, Any]]:
    """The `gateway.routes` entries by model; SettingsError for one named twice or one listing workers
    for a model this config's workers serve (strata up fills those in)."""
    by_model: dict[str, Mapping[str, Any]] = {}
    for entry in options:
        model = entry["model"]
        if model in by_model:
            raise SettingsError(f"gateway.routes names model {model!r} twice; merge the two entries")
        if model in models and "workers" in entry:
            raise SettingsError(
                f"gateway.routes entry {model!r} lists workers, but this config's workers serve that model "
                "and strata up fills in their addresses: remove its workers key"
            )
        by_model[model] = entry
    return by_model


def routes_json(models: list[str], addresses: list[str], options: Sequence[Mapping[str, Any]] = ()) -> str:
    """STRATA_GATEWAY_ROUTES: one route per worker model name, listing its workers in index order.

    Each route takes the keys of the `options` entry naming the same model (fallback, queue limits,
    ...); an entry with `dns` keeps it instead of the address list (the name must resolve to the
    workers started here), and one for a model no worker here serves is passed on as is.
    """
    served: dict[str, list[str]] = {}
    for model, address in zip(models, addresses, strict=True):
        served.setdefault(model, []).append(address)
    by_model = check_route_options(models, options)
    routes = [_route(by_model.get(model, {}), model, workers) for model, workers in served.items()]
    routes += [dict(entry) for model, entry in by_model.items() if model not in served]
    return json.dumps(routes)


def gateway_is_open(config_path: Path) -> bool:
    """Whether the launcher can call the gateway itself: plaintext and no API keys (tenants have keys
    too). Otherwise its readiness (every route served) is all the launcher waits for."""
    gateway = read_config(config_path).get("gateway") or {}
    return (
        isinstance(gateway, dict)
        and not gateway.get("tls")
        and not (gateway.get("api_keys") or gateway.get("api_keys_file") or gateway.get("tenants"))
    )


def _route(entry: Mapping[str, Any], model: str, workers: list[str]) -> dict[str, Any]:
    """A served model's route: its options, and the started workers' addresses unless it finds its
    workers by a DNS name (replicas behind one name; the gateway resolves it)."""
    if "dns" in entry:
        return {**entry, "model": model}
    return {**entry, "model": model, "workers": workers}
