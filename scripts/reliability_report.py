"""Run the reliability suite's full versions and write docs/reliability.md from what they measured.

`make reliability` runs this: pytest on tests/reliability and on the tests elsewhere that a scenario
names in its `run` key (the security promises of tests/integration/test_security.py), in a subprocess
with STRATA_RELIABILITY_FULL=1 and STRATA_RELIABILITY_FIGURES pointing at a scratch file, where each
test appends the figures it measures (the `figure` fixture of tests/figures.py), plus a JUnit XML file
for each test's outcome. The report is one table row per scenario: what was done, what must hold (both
written in scripts/reliability_scenarios.py), the figures measured and pass or fail, and it states the
run's own date, commit (and whether the tree was dirty), command, machine, load and run time
(bench/provenance.py describes them, as it does for every record): docs/reliability.md is the one
place these figures live, and other pages link to it. A scenario's tests are those whose id matches
one of its patterns, plus any test that recorded a figure for it.

`--quick` runs the short versions CI runs and never writes docs/reliability.md: its report goes to
build/reliability-quick.md (git-ignored), titled as a quick run. `--only N` runs one scenario's tests
(those its `run` names, or the suite's modules named after its patterns) and replaces that scenario's
row of the existing report, saying when and at which commit it ran alone; the rest stays as the last
whole run wrote it (`make chaos` is `--only 11`). This module must not judge a figure: the tests
assert; the report only shows what they measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "reliability.md"
QUICK_OUTPUT = ROOT / "build" / "reliability-quick.md"
SUITE = "tests/reliability"
FIGURES_ENV = "STRATA_RELIABILITY_FIGURES"
"""Read by the `figure` fixture (tests/figures.py)."""

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its scenarios, also when loaded by path
from reliability_scenarios import SCENARIOS  # noqa: E402

sys.path.insert(0, str(ROOT))  # bench/, when run as a script
from bench.provenance import finish_provenance, start_provenance  # noqa: E402


@dataclass
class Scenario:
    number: int
    tests: dict[str, str] = field(default_factory=dict)
    """Outcome (passed, failed, error, skipped) by test id."""
    figures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def result(self) -> str:
        if not self.tests:
            return "not run"
        if all(outcome == "passed" for outcome in self.tests.values()):
            return "pass"
        return "FAIL"


def dotted(nodeid: str) -> str:
    """A pytest node id as JUnit names it: tests/a/b.py::f[x] -> tests.a.b.f[x]."""
    path, _, rest = nodeid.partition("::")
    return path.removesuffix(".py").replace("/", ".") + "." + rest.replace("::", ".")


def selection() -> list[str]:
    """What the run gives pytest: the reliability suite, then each scenario's tests outside it."""
    paths = [SUITE]
    for spec in SCENARIOS.values():
        paths += [path for path in spec.get("run", ()) if path not in paths]
    return paths


def scenario_selection(number: int) -> list[str]:
    """What a run of one scenario gives pytest: its `run`, or the suite's modules named after its patterns."""
    spec = SCENARIOS[number]
    paths = list(spec.get("run", ())) or sorted(
        str(path.relative_to(ROOT))
        for pattern in spec["tests"]
        for path in (ROOT / SUITE).glob(f"{pattern}*.py")
    )
    if not paths:
        raise SystemExit(f"scenario {number} names no module of its own to run alone; run the whole suite")
    return paths


def run_suite(
    figures: Path, junit: Path, quick: bool, pytest_args: list[str], paths: list[str] | None = None
) -> tuple[int, float]:
    venv = ROOT / ".venv" / "bin" / "python"
    python = str(venv) if venv.exists() else sys.executable
    env = {**os.environ, FIGURES_ENV: str(figures)}
    env["STRATA_RELIABILITY_FULL"] = "0" if quick else "1"
    chosen = paths or selection()
    command = [python, "-m", "pytest", *chosen, "-p", "no:cacheprovider", f"--junitxml={junit}"]
    started = time.monotonic()
    code = subprocess.call([*command, *pytest_args], cwd=ROOT, env=env)
    return code, time.monotonic() - started


@dataclass
class Collected:
    scenarios: dict[int, Scenario]
    outside: dict[str, str] = field(default_factory=dict)
    """Outcome by test id of the tests of the run that belong to no scenario."""
    strays: list[str] = field(default_factory=list)
    """Figures recorded for a scenario number that SCENARIOS does not have."""


def collect(figures: Path, junit: Path) -> Collected:
    collected = Collected({number: Scenario(number) for number in SCENARIOS})
    scenarios = collected.scenarios
    outcomes: dict[str, tuple[str, float]] = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            test = f"{case.get('classname', '')}.{case.get('name', '')}"
            outcome = next(
                (child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed"
            )
            outcomes[test] = ("failed" if outcome == "failure" else outcome, float(case.get("time", 0)))
    lines = figures.read_text().splitlines() if figures.exists() else []
    for line in lines:
        record = json.loads(line)
        value = record["value"]
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        text = f"{record['name']}: {shown} {record.get('unit', '')}".rstrip()
        test = dotted(str(record.get("test", "")))
        scenario = scenarios.get(int(record["scenario"]))
        if scenario is None:
            collected.strays.append(f"scenario {record['scenario']} ({test}): {text}")
            continue
        scenario.figures.append(text)
        scenario.tests.setdefault(test, outcomes.get(test, ("failed", 0.0))[0])
    for test, (outcome, seconds) in outcomes.items():
        owners = [
            scenario
            for number, scenario in scenarios.items()
            if any(pattern in test for pattern in SCENARIOS[number]["tests"]) or test in scenario.tests
        ]
        for scenario in owners:
            scenario.tests[test] = outcome
            scenario.seconds += seconds
        if not owners:
            collected.outside[test] = outcome
    return collected


def machine(provenance: dict[str, Any]) -> str:
    spec = provenance["machine"]
    system = f"{platform.system()} {platform.release()}"
    return (
        f"{spec['cpu_model']}, {spec['usable_cpus']} usable CPUs, native kernels {spec['isa']}, {system}, "
        f"Python {provenance['versions']['python']}, torch {provenance['versions']['torch']}"
    )


def checkout(provenance: dict[str, Any]) -> str:
    """The commit the run measured, and whether the tree differed from it."""
    tree = "a dirty tree: figures of uncommitted code" if provenance["dirty"] else "a clean tree"
    return f"{str(provenance['commit'])[:7] or 'outside git'} ({tree})"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def row(scenario: Scenario, note: str = "") -> str:
    """The report's table row of one scenario; `note` goes into its Result cell."""
    spec = SCENARIOS[scenario.number]
    figures = "<br>".join(cell(f) for f in scenario.figures) or "(none recorded)"
    texts = " | ".join(cell(str(spec[key])) for key in ("title", "done", "holds"))
    result = f"{scenario.result} ({scenario.seconds:.0f} s{note})"
    return f"| {scenario.number} | {texts} | {figures} | {result} |"


def replace_row(report: str, scenario: Scenario, note: str) -> str:
    """`report` with the scenario's row replaced, or inserted before the first row of a higher number."""
    lines = report.splitlines()
    rows = {i: re.match(r"\| (\d+) \| ", line) for i, line in enumerate(lines)}
    numbers = {i: int(match.group(1)) for i, match in rows.items() if match}
    if not numbers:
        raise SystemExit("the report has no scenario rows to replace; run the whole suite first")
    new = row(scenario, note)
    at = next((i for i, n in numbers.items() if n == scenario.number), None)
    if at is not None:
        lines[at] = new
    else:
        after = [i for i, n in numbers.items() if n > scenario.number]
        lines.insert(after[0] if after else max(numbers) + 1, new)
    return "\n".join(lines) + "\n"


def render(collected: Collected, code: int, seconds: float, quick: bool, provenance: dict[str, Any]) -> str:
    scenarios = collected.scenarios
    version = "short (CI)" if quick else "full"
    load = (provenance["load_average"]["start"][0], provenance["load_average"]["end"][0])
    rows = [
        "| # | Scenario | What was done | What must hold | Figures measured | Result |",
        "|---|---|---|---|---|---|",
    ]
    rows += [row(scenario) for scenario in scenarios.values()]
    tests = {test: outcome for s in scenarios.values() for test, outcome in s.tests.items()}
    failing = sorted(test for test, outcome in {**tests, **collected.outside}.items() if outcome != "passed")
    if quick:
        title = "# Reliability report: QUICK RUN (the short CI versions), not the record"
        made = "`scripts/reliability_report.py --quick`"
        record = [
            "Its figures come from the short versions and are not the project's reliability figures:",
            "docs/reliability.md, written by the full run, is the record.",
        ]
    else:
        title = "# Reliability report"
        made = "`make reliability` (scripts/reliability_report.py)"
        record = ["The one record of the reliability figures: other pages link here, never restate them."]
    lines = [
        title,
        "",
        f"Generated by {made} from the tests in {SUITE} and those a scenario names",
        "outside it (its `run`); do not edit by hand. Each figure is measured by the scenario's tests; the",
        "bounds they assert are in their modules.",
        *record,
        "",
        f"- Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Commit: {checkout(provenance)}",
        f"- Command: `{' '.join(provenance['command'])}`",
        f"- Machine: {machine(provenance)}",
        f"- Load average (1 minute) at start and end: {load[0]:.2f} and {load[1]:.2f}",
        f"- Version: {version}; pytest exit code {code}",
        f"- Run time: {seconds:.0f} s ({seconds / 60:.1f} minutes), every scenario's tests in one pytest run "
        "(each row's Result gives its own tests' seconds)",
        "",
        *rows,
        "",
    ]
    if failing:
        lines += ["## Tests that did not pass", "", *(f"- `{test}`" for test in failing), ""]
    if collected.strays:
        strays = [f"- {cell(stray)}" for stray in collected.strays]
        lines += ["## Figures for no scenario of the report", "", *strays, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = OUTPUT.relative_to(ROOT)
    parser.add_argument("--output", type=Path, help=f"where to write the report (default {default})")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"the short CI versions instead of the full ones; the report goes to "
        f"{QUICK_OUTPUT.relative_to(ROOT)} and never to {OUTPUT.relative_to(ROOT)}",
    )
    parser.add_argument(
        "--only",
        type=int,
        choices=sorted(SCENARIOS),
        help="run this scenario alone and replace its row of the existing report",
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    output: Path = args.output or (QUICK_OUTPUT if args.quick else OUTPUT)
    if args.quick and output.resolve() == OUTPUT.resolve():
        parser.error(f"--quick never writes {OUTPUT.relative_to(ROOT)}: that is the full run's record")
    if args.only and not output.exists():
        parser.error(f"--only replaces a row of {output}, which does not exist: run the whole suite first")
    paths = scenario_selection(args.only) if args.only else None
    provenance = start_provenance()
    with tempfile.TemporaryDirectory(prefix="strata-reliability-") as scratch:
        figures, junit = Path(scratch) / "figures.jsonl", Path(scratch) / "junit.xml"
        code, seconds = run_suite(figures, junit, args.quick, args.pytest_args, paths)
        collected = collect(figures, junit)
    finish_provenance(provenance)
    output.parent.mkdir(parents=True, exist_ok=True)
    if args.only:
        scenario = collected.scenarios[args.only]
        when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        note = f"; run alone on {when} at {checkout(provenance)}"
        output.write_text(replace_row(output.read_text(), scenario, note))
        print(f"scenario {args.only:2}: {scenario.result}")
    else:
        output.write_text(render(collected, code, seconds, args.quick, provenance))
        for number, scenario in collected.scenarios.items():
            print(f"scenario {number:2}: {scenario.result}")
    print(f"wrote {output}")
    return code


if __name__ == "__main__":
    sys.exit(main())
