"""A stack config copied for one benchmark run: some sections' keys set, every path made absolute.

Benchmarks that start a fresh stack per contestant (bench/trace_overhead.py: tracing off and on;
bench/tenant_run.py: fair queuing on and off), or a stack whose routes must admit a whole closed
loop (`strata bench --spawn` without --rate; `admit_all`), write such a copy into a scratch folder
and hand it to the launcher. Each service's own settings class resolves its path fields against the
source file's folder, so the copy can live anywhere and the launcher reads the same services and
routes. This module only writes the file; it must not validate a section (the services do when they
start) nor start anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml

from strata.settings import SettingsError, read_config

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path


def admit_all(source: Path, requests: int) -> dict[str, Any]:
    """The `gateway` override under which every route of `source` admits `requests` at once: no TTFT
    SLO, a queue that long. For benchmarks whose subject is not admission (a closed loop's throughput,
    tracing's cost): a forecast of this machine's speed refusing part of their burst would void them."""
    gateway = read_config(source.resolve()).get("gateway") or {}
    settings = {"ttft_slo_ms": 0.0, "max_queued_requests": max(requests, 1)}
    return {"routes": [{**route, **settings} for route in gateway.get("routes") or []]}


def write_config(
    source: Path, directory: Path, name: str, overrides: Mapping[str, Mapping[str, Any]]
) -> Path:
    """`source` with each section of `overrides` holding its keys (the section's other keys kept)
    and every path absolute, as `directory`/`name`.yaml.

    The overrides are applied before the paths are resolved, so a top-level `telemetry` override
    reaches every service's merged telemetry as it would in the source.
    """
    from gateway.settings import GatewaySettings
    from services.tokenizer.settings import TokenizerSettings
    from services.worker.settings import WorkerSettings

    path = source.resolve()
    config = read_config(path)
    for section, keys in overrides.items():
        current = config.get(section) or {}
        if not isinstance(current, dict):
            raise SettingsError(f"{path}: section {section!r} must be a mapping to set {sorted(keys)} in it")
        config[section] = {**current, **keys}
    config["tokenizer"] = TokenizerSettings.section_data(config, path)
    workers = config.get("workers")
    count = len(workers) if isinstance(workers, list) else 0
    config["workers"] = [WorkerSettings.section_data(config, path, index) for index in range(count)]
    config["gateway"] = GatewaySettings.section_data(config, path)
    out = directory / f"{name}.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out
