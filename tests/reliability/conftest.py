"""Fixtures of the reliability suite: recording measured figures, and choosing the short or full run.

`figure(scenario, name, value, unit)` appends one JSON line to the file named by
STRATA_RELIABILITY_FIGURES (scripts/reliability_report.py sets it and turns the lines into
docs/reliability.md); without the variable it only prints. `full` is True under
STRATA_RELIABILITY_FULL=1, the long versions `make reliability` runs; CI runs the short ones. This
module must not start services nor assert anything about them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Protocol

import pytest

FIGURES_ENV = "STRATA_RELIABILITY_FIGURES"
FULL_ENV = "STRATA_RELIABILITY_FULL"
SCENARIOS = range(1, 12)
"""The scenario numbers of scripts/reliability_report.py's SCENARIOS."""


class Figure(Protocol):
    def __call__(self, scenario: int, name: str, value: float | int | str, unit: str = "") -> None: ...


@pytest.fixture
def figure(request: pytest.FixtureRequest) -> Figure:
    """Record one measured figure of a scenario (a number of SCENARIOS) for the reliability report."""
    target = os.environ.get(FIGURES_ENV, "")
    test = request.node.nodeid

    def record(scenario: int, name: str, value: float | int | str, unit: str = "") -> None:
        if scenario not in SCENARIOS:
            raise ValueError(f"scenario {scenario} is not one of {SCENARIOS.start}-{SCENARIOS.stop - 1}")
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


@pytest.fixture(scope="session")
def full() -> bool:
    """True for the full versions of the scenarios (STRATA_RELIABILITY_FULL=1), else the short CI ones."""
    return os.environ.get(FULL_ENV, "") == "1"
