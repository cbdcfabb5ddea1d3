"""The CPU workers' memory in the Kubernetes manifests follows from what the worker was measured to need.

The worker sizes its KV cache from its cgroup's limit, so a manifest's memory limit is a sizing
decision: it must cover what `bench.memory_profile` measured the model, context and batch to need
(bench/results/memory-profile-cpu.json), and the request must equal the limit. This module must not
need a cluster or a container engine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.worker.settings import WorkerSettings
from tests.k8s_manifests import K8S, WORKERS, Obj, containers, load_as, named, render, settings_file


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {"cpu": render("cpu")}


@pytest.fixture(autouse=True)
def _no_strata_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the manifests' variables may shape the settings under test.
    for name in [name for name in os.environ if name.startswith(("STRATA_", "OTEL_"))]:
        monkeypatch.delenv(name)


MEMORY_RECORD = K8S.parents[1] / "bench" / "results" / "memory-profile-cpu.json"
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def mebibytes(quantity: str) -> float:
    suffix = quantity[-2:]
    return int(quantity[:-2]) * _UNITS[suffix] / 2**20 if suffix in _UNITS else int(quantity) / 2**20


def test_cpu_worker_memory_follows_from_the_model_and_settings(
    rendered: dict[str, list[Obj]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each CPU worker's memory limit is at least what bench.memory_profile measured its model, context
    and batch to need to start (one max_model_len request in the cache, at its memory_utilization), and
    its request equals its limit: the cgroup limit the worker sizes its cache from is the memory the
    scheduler reserved for it, and no setting repeats it."""
    if not MEMORY_RECORD.exists():
        # The record is rerun by `make records` (python -m bench.memory_profile); until then there is
        # no measured peak to hold the manifests to, and a guessed one would prove nothing.
        pytest.skip(f"{MEMORY_RECORD.name} awaits a rerun by make records: no measured peak to check")
    record = json.loads(MEMORY_RECORD.read_text())
    objs = rendered["cpu"]
    path = settings_file(objs, tmp_path)
    for name in WORKERS:
        deployment = named(objs, "Deployment", name)
        worker = load_as(deployment, path, monkeypatch)
        assert isinstance(worker, WorkerSettings)
        resources = containers(deployment, init=False)[0]["resources"]
        assert resources["requests"]["memory"] == resources["limits"]["memory"], name
        engine = worker.engine
        assert engine.num_blocks is None and engine.kv_cache_memory_bytes is None, "sized from memory"
        [row] = [
            row
            for row in record["rows"]
            if Path(row["model"].partition(":")[0]).name == Path(worker.model_path).name
            and row["context"] == (engine.max_model_len or row["model_max_len"])
            and row["seqs"] == engine.max_num_seqs
            and row["batched"] == engine.max_num_batched_tokens
        ]
        needed = row["limit_to_start_mib"] * record["memory_utilization"] / engine.memory_utilization
        assert mebibytes(str(resources["limits"]["memory"])) >= needed, (name, row)
