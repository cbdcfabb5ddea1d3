"""The chaos soak's stacks: the short run's tiny models and the full run's copy of configs/local.yaml.

The full run serves configs/local.yaml's stack with one change: a fallback on torch's dynamic int8
(the product's, whose greedy output depends on the requests next to it) runs int8-weight-only
instead, whose greedy output does not, so the soak can check every one of its tokens exactly. The
copy's relative paths are resolved against configs/, where the original lies. This module must not
start services nor check answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml

from services.worker.model.dynamic_int8 import DYNAMIC_INT8, WEIGHT_ONLY_INT8
from strata.settings import DEFAULT_CONFIG, resolve_path
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from pathlib import Path

TINY_ENGINE = {"num_blocks": 256, "max_num_seqs": 16, "max_num_batched_tokens": 256}
TINY_STEP_DELAY_S = 0.02
BATCH_DEPENDENT = frozenset({DYNAMIC_INT8})
"""Quantizations whose greedy output depends on the batch: the soak's token check refuses them."""


def tiny_config(path: Path, primary: Path, fallback: Path) -> Path:
    """The short run's stack: a tokenizer, a tiny primary and a tiny fallback worker, one gateway."""
    engine = {**TINY_ENGINE, "enable_fault_injection": True, "fault_step_delay_s": TINY_STEP_DELAY_S}
    worker = {"listen": "127.0.0.1:0", "device": "cpu", "threads": 1, "engine": engine, "drain_timeout_s": 5}
    config = {
        "telemetry": {"log_format": "text"},
        "tokenizer": {"listen": "127.0.0.1:0", "models": {"tiny": str(primary), "tiny-fb": str(fallback)}},
        "workers": [
            {**worker, "model_name": "tiny", "model_path": str(primary)},
            {**worker, "model_name": "tiny-fb", "model_path": str(fallback)},
        ],
        "gateway": {
            "listen": "127.0.0.1:0",
            "default_model": "tiny",
            "reconnect_backoff_max_s": 0.5,
            "routes": [harness_route("tiny", fallback="tiny-fb"), harness_route("tiny-fb")],
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def full_config(path: Path, source: Path = DEFAULT_CONFIG) -> Path:
    """`source` (configs/local.yaml) with each dynamic-int8 worker on int8-weight-only, at `path`."""
    config: dict[str, Any] = yaml.safe_load(source.read_text())
    base = source.parent
    tokenizer = config["tokenizer"]
    tokenizer["models"] = {name: resolve_path(folder, base) for name, folder in tokenizer["models"].items()}
    swapped = 0
    for worker in config["workers"]:
        worker["model_path"] = resolve_path(worker["model_path"], base)
        if worker.get("quantization") == DYNAMIC_INT8:
            worker["quantization"] = WEIGHT_ONLY_INT8
            swapped += 1
    if not swapped:
        raise ValueError(f"{source} has no {DYNAMIC_INT8} worker: the full soak expects its int8 fallback")
    path.write_text(yaml.safe_dump(config))
    return path
