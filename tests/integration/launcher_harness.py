"""What the tests of the launcher and of `strata up` share: a one-model stack config on the tiny
model, and whether processes have ended.

The config's route carries tests/route_defaults.py's NO_SLO_ROUTE (no TTFT SLO, queue bounds no
burst fills): a stack started for a correctness test refuses nothing for the machine's speed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import psutil
import yaml

from tests.polling import poll
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from pathlib import Path


def write_tiny_config(path: Path, model_dir: Path, **worker_overrides: object) -> Path:
    """A stack config serving `model_dir` as model "tiny", every service on a free port."""
    worker = {
        "model_name": "tiny",
        "model_path": str(model_dir),
        "listen": "127.0.0.1:0",
        "device": "cpu",
        "threads": 1,
        "engine": {"num_blocks": 128, "max_num_seqs": 16},
        **worker_overrides,
    }
    config = {
        "tokenizer": {"listen": "127.0.0.1:0", "models": {"tiny": str(model_dir)}},
        "workers": [worker],
        "gateway": {
            "listen": "127.0.0.1:0",
            "http_listen": "127.0.0.1:0",
            "default_model": "tiny",
            "routes": [harness_route("tiny")],
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def running(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def gone(pids: list[int], within_s: float) -> bool:
    """Whether every process in `pids` has ended within `within_s` seconds."""
    return poll(lambda: not any(running(pid) for pid in pids), within_s, interval_s=0.1)
