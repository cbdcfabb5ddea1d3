"""scripts/reliability_report.py's `--only`: a scenario run alone replaces its own row of the report
(or inserts it in number order) and leaves every other line as it was, and its tests are found by
its `run` or by module name; the report and a row run alone name the commit they measured, which the
docs' long-runs table reads back. Nothing here runs the suite."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.provenance import finish_provenance, git_checkout, start_provenance

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reliability_report.py"


@pytest.fixture(scope="module")
def report() -> Any:
    spec = importlib.util.spec_from_file_location("reliability_report", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _report(module: Any, numbers: list[int]) -> str:
    scenarios = {
        n: module.Scenario(n, tests={f"t{n}": "passed"}, figures=[f"f{n}"], seconds=n) for n in numbers
    }
    provenance = finish_provenance(start_provenance())
    return str(module.render(module.Collected(scenarios), 0, 60.0, False, provenance))


def test_the_report_and_a_row_run_alone_name_their_commit_and_the_runs_table_shows_it(report: Any) -> None:
    from docs_tables_runs import long_runs

    commit, dirty = git_checkout()
    whole = _report(report, [1, 11])
    assert f"- Commit: {commit[:7]} (a {'dirty' if dirty else 'clean'} tree" in whole
    assert "- Load average (1 minute) at start and end: " in whole
    alone = report.replace_row(
        whole, report.Scenario(11), "; run alone on 2026-12-01 08:37 UTC at 1234567 (a dirty tree)"
    )
    rows = [line for line in long_runs(alone) if line.startswith("| the ")]
    expected_whole = f"`{commit[:7]}`" + (" (dirty tree)" if dirty else "")
    assert rows[0].split(" | ")[2] == expected_whole
    assert rows[1].split(" | ")[1:3] == ["2026-12-01 08:37 UTC", "`1234567` (dirty tree)"]
    assert "not recorded" in long_runs("# a report from before commits were recorded\n- Date: x\n")[2]


def test_a_scenario_run_alone_replaces_its_row_and_nothing_else(report: Any) -> None:
    before = _report(report, [1, 10, 11, 12])
    ran = report.Scenario(11, tests={"t": "failed"}, figures=["new figure"], seconds=512.4)
    after = report.replace_row(before, ran, "; run alone on 2026-12-01 08:37 UTC")
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b]
    assert len(changed) == 1
    assert changed[0][1].startswith("| 11 | Chaos soak |")
    assert changed[0][1].endswith("| new figure | FAIL (512 s; run alone on 2026-12-01 08:37 UTC) |")


def test_a_row_the_report_lacks_goes_in_number_order(report: Any) -> None:
    before = _report(report, [1, 10, 12])
    after = report.replace_row(before, report.Scenario(11, figures=["x"]), "")
    numbers = [
        line.split(" | ")[0] for line in after.splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert numbers == ["| #", "| 1", "| 10", "| 11", "| 12"]
    last = report.replace_row(before, report.Scenario(16, figures=["y"]), "")
    assert [line for line in last.splitlines() if line.startswith("| ")][-1].startswith("| 16 |")
    with pytest.raises(SystemExit, match="no scenario rows"):
        report.replace_row("# empty\n", report.Scenario(11), "")


def test_a_scenario_is_run_alone_by_its_run_or_its_modules(report: Any) -> None:
    assert report.scenario_selection(11) == ["tests/reliability/test_s11_chaos.py"]
    assert report.scenario_selection(16) == ["tests/integration/test_supervision.py"]
    with pytest.raises(SystemExit, match="scenario 2"):
        report.scenario_selection(2)  # its tests are named inside a module shared with scenario 3
