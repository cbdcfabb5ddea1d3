"""scripts/reliability_report.py's record of results: a run replaces the entries of the scenarios it
ran and keeps the others, the report marks rows an earlier run recorded, and `--only` finds a
scenario's modules. Nothing here runs the suite."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reliability_report.py"


@pytest.fixture(scope="module")
def report() -> Any:
    spec = importlib.util.spec_from_file_location("reliability_report", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


DATE = "2026-12-01 10:00 UTC"
RUN = {
    "date": DATE,
    "version": "full",
    "scope": "scenario 11 only",
    "code": 1,
    "seconds": 600,
}


def _entry(result: str, date: str, failing: list[str] | None = None) -> dict[str, Any]:
    return {
        "result": result,
        "seconds": 7,
        "figures": [f"{result} figure"],
        "failing": failing or [],
        "date": date,
        "version": "full",
    }


def test_a_run_replaces_what_it_ran_and_keeps_the_rest(report: Any) -> None:
    previous = {"1": _entry("pass", "2026-11-30 06:51 UTC"), "11": _entry("pass", "2026-11-30 06:51 UTC")}
    ran = report.Scenario(
        11, tests={"tests.reliability.test_s11_chaos.test_x": "failed"}, figures=["f"], seconds=9.4
    )
    scenarios = {number: report.Scenario(number) for number in report.SCENARIOS} | {11: ran}
    merged = report.merge_results(previous, scenarios, RUN)
    assert merged["1"] == previous["1"]
    assert merged["11"] == {
        "result": "FAIL",
        "seconds": 9,
        "figures": ["f"],
        "failing": ["tests.reliability.test_s11_chaos.test_x"],
        "date": RUN["date"],
        "version": "full",
    }
    assert "2" not in merged


def test_the_report_says_which_rows_an_earlier_run_recorded(report: Any) -> None:
    results = {
        "1": _entry("pass", "2026-11-30 06:51 UTC"),
        "11": _entry("FAIL", DATE, ["tests.reliability.test_s11_chaos.test_x"]),
    }
    text = report.render(results, RUN)
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["| 1"].endswith("| pass (7 s; full run of 2026-11-30 06:51 UTC) |")
    assert rows["| 11"].endswith("| FAIL figure | FAIL (7 s) |")
    assert rows["| 2"].endswith("| (none recorded) | not run |")
    assert "- Version: full; scenario 11 only; pytest exit code 1; 600 s in all" in text
    assert "- `tests.reliability.test_s11_chaos.test_x`" in text


def test_only_finds_a_scenarios_modules_by_name(report: Any) -> None:
    assert report.scenario_modules(11) == ["tests/reliability/test_s11_chaos.py"]
    with pytest.raises(SystemExit, match="scenario 2"):
        report.scenario_modules(2)  # its tests are named inside a module shared with scenario 3
