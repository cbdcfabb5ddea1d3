"""The `figure` fixture: a test records what it measured for a scenario of the reliability report.

`figure(scenario, name, value, unit)` appends one JSON line to the file named by
STRATA_RELIABILITY_FIGURES (scripts/reliability_report.py sets it and turns the lines into
docs/reliability.md, one row per scenario of scripts/reliability_scenarios.py); without the variable it
only prints. tests/conftest.py loads this module as a plugin, so the reliability suite and the
integration tests whose promises the report lists (tests/integration/test_security.py) record through
the same fixture. This module must not start services nor assert anything about them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Protocol

import pytest

FIGURES_ENV = "STRATA_RELIABILITY_FIGURES"


class Figure(Protocol):
    def __call__(self, scenario: int, name: str, value: float | int | str, unit: str = "") -> None: ...


@pytest.fixture
def figure(request: pytest.FixtureRequest) -> Figure:
    """Record one measured figure of a scenario (its number in scripts/reliability_scenarios.py)."""
    target = os.environ.get(FIGURES_ENV, "")
    test = request.node.nodeid

    def record(scenario: int, name: str, value: float | int | str, unit: str = "") -> None:
        if scenario < 1:
            raise ValueError(f"scenario {scenario} is not a scenario number (1, 2, ...)")
        if isinstance(value, float):
            value = round(value, 4)
        print(f"figure: scenario {scenario}: {name} = {value} {unit}".rstrip())
        if not target:
            return
        line = {"scenario": scenario, "name": name, "value": value, "unit": unit, "test": test}
        line["recorded_at"] = time.time()
        with Path(target).open("a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")

    return record
