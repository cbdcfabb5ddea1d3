"""tests/gpu needs a CUDA device: without one (CI has none) its tests are collected and reported as
skipped, with the reason, so a CPU run shows that they exist and did not run.

bench/gpu.sh runs them on a machine with a GPU. The skip is added at collection, before any fixture
is set up, and only to the tests of this folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_CUDA = "needs a CUDA device and torch sees none: run it on a GPU machine (bench/gpu.sh does)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(skip)
