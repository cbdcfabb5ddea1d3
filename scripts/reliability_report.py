"""Run the reliability suite's full versions and write docs/reliability.md from what they measured.

`make reliability` runs this: `pytest tests/reliability` in a subprocess with STRATA_RELIABILITY_FULL=1
and STRATA_RELIABILITY_FIGURES pointing at a scratch file, where each scenario's tests append the
figures they measure (tests/reliability/conftest.py), plus a JUnit XML file for each test's outcome.
The report is one table row per scenario of the reliability suite: what was done, what must hold (both written
here, in SCENARIOS), the figures measured and pass or fail. A scenario's tests are those whose id
matches one of its patterns, plus any test that recorded a figure for it.

Each scenario's latest outcome is kept in docs/reliability-results.json, and the report is rendered
from that file: a run updates the scenarios it ran and leaves the others as last recorded, so
`--only N` (`make chaos` is `--only 11`) runs one scenario's modules and rewrites its row alone; a row
recorded by an earlier run says when. This module must not judge a figure: the tests assert; the
report only shows what they measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
RESULTS = ROOT / "docs" / "reliability-results.json"
SUITE = "tests/reliability"

SCENARIOS: dict[int, dict[str, str | tuple[str, ...]]] = {
    1: {
        "title": "Overload burst",
        "done": "A burst of 200 requests at once against a worker of 4 credits and a route queue of 4, "
        "each admitted request running 3 s (test-mode step delay).",
        "holds": "Exactly 200 - (4 + 4) refused with RESOURCE_EXHAUSTED and a RetryInfo retry hint; "
        "every accepted request completes with all its tokens.",
        "tests": ("test_s01_",),
    },
    2: {
        "title": "kill -9 of the primary mid-stream",
        "done": "SIGKILL of the primary worker 5 tokens into a 60-token stream; then a restart of it "
        "on its old port.",
        "holds": "The stream continues on the fallback with no token lost or repeated; new requests "
        "are served by the fallback; the restarted primary serves again.",
        "tests": ("test_failover.test_kill9",),
    },
    3: {
        "title": "SIGSTOP of the primary",
        "done": "SIGSTOP of the primary worker, then SIGCONT.",
        "holds": "Noticed within 3 s (traffic on the fallback; 15 s asserted); the primary serves "
        "again after SIGCONT.",
        "tests": ("test_failover.test_sigstop",),
    },
    4: {
        "title": "Graceful shutdown under load",
        "done": "SIGTERM to the tokenizer, the worker and the gateway in turn (a fresh stack each) "
        "while 32 streams run; grace and drain 10 s.",
        "holds": "Health NOT_SERVING first; running streams finish (gateway, worker) or end UNAVAILABLE "
        "(tokenizer); new calls get UNAVAILABLE; exit code 0 before the grace ends; the launcher "
        "restarts nothing.",
        "tests": ("test_s04_",),
    },
    5: {
        "title": "Deadlines and cancellation",
        "done": "Requests with 0.5, 1 and 2 s deadlines against 20 s generations; streams cancelled "
        "after 3 tokens, alone and next to another request.",
        "holds": "DEADLINE_EXCEEDED at the deadline; the worker frees the KV blocks within one engine "
        "step of the cancel (<= 1 step alone, <= 2 with another request, as GetWorkerStats shows it).",
        "tests": ("test_s05_",),
    },
    6: {
        "title": "Bad input, fuzzed",
        "done": "Generated GenerateRequests (invalid UTF-8, huge and negative numbers, empty and "
        "oversized fields, thousands of stop strings, unknown models) and raw undecodable bytes.",
        "holds": "Every answer OK or a documented status, never UNKNOWN or INTERNAL; the stack stays "
        "healthy and serves a good request after each run.",
        "tests": ("test_s06_", "fuzz"),
    },
    7: {
        "title": "Soak",
        "done": "5,000 requests from 16 clients on the tiny model: mixed lengths, 10% cancelled "
        "mid-stream, 10% with 20-300 ms deadlines.",
        "holds": "Running and waiting counts, KV blocks and the gateway queue return exactly to their "
        "initial values; each service's RSS grows at most 20% after the warm-up.",
        "tests": ("test_s07_",),
    },
    8: {
        "title": "Tokenizer dies and comes back",
        "done": "SIGKILL of the tokenizer service, requests while it is down (30 s deadlines), then a "
        "new tokenizer process on the same port.",
        "holds": "While down each request fails with UNAVAILABLE within 1 s; requests succeed again "
        "within 2 s of its return (10 s asserted).",
        "tests": ("test_s08_",),
    },
    9: {
        "title": "Slow or stuck client",
        "done": "A client that stops reading its stream.",
        "holds": "The gateway does not buffer without bound nor hold KV blocks forever: the configured "
        "idle timeout aborts the request.",
        "tests": ("test_s09_", "stuck", "slow_client"),
    },
    10: {
        "title": "Batching invariance under load",
        "done": "32 concurrent greedy requests of mixed prompt lengths through the stack (chunked "
        "prefills mixed with decodes).",
        "holds": "Each output equals the prompt's solo output (transformers, one at a time) under the "
        "parity rule of tests/parity.py.",
        "tests": ("test_s10_",),
    },
    11: {
        "title": "Chaos soak",
        "done": "Open-loop load through the client SDK (unary and streams, mixed lengths, client cancels, "
        "short deadlines, greedy with ignore_eos and some sampled) while a seeded injector hits the "
        "primary worker, the fallback worker and the tokenizer in turn with kill -9, SIGSTOP then "
        "SIGCONT and SIGTERM, and the gateway with kill -9; `strata up`'s supervisor restarts them. "
        "Full (`make chaos`): configs/local.yaml's stack (SmolLM2-135M-Instruct, int8 fallback), 8 "
        "minutes, 18 faults; CI: tiny models, 60 s, 10 faults.",
        "holds": "Every completed greedy answer's tokens equal the primary's reference before "
        "failover_at_token and the fallback's greedy continuation after it (parity rule at near ties); "
        "failures end UNAVAILABLE, RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED (or CANCELLED by the client), "
        "at most 1 s past their deadline; SDK retries rescue some; after each fault fully serving within "
        "10 s plus the stack's start time, one restart per kill or SIGTERM; worker and gateway state "
        "back exactly to idle; RSS growth at most 5% after a warm baseline.",
        "tests": ("test_s11_",),
    },
}


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


def run_suite(
    figures: Path, junit: Path, quick: bool, pytest_args: list[str], paths: list[str] | None = None
) -> tuple[int, float]:
    venv = ROOT / ".venv" / "bin" / "python"
    python = str(venv) if venv.exists() else sys.executable
    env = {**os.environ, "STRATA_RELIABILITY_FIGURES": str(figures)}
    env["STRATA_RELIABILITY_FULL"] = "0" if quick else "1"
    command = [python, "-m", "pytest", *(paths or [SUITE]), "-p", "no:cacheprovider", f"--junitxml={junit}"]
    started = time.monotonic()
    code = subprocess.call([*command, *pytest_args], cwd=ROOT, env=env)
    return code, time.monotonic() - started


def scenario_modules(number: int) -> list[str]:
    """The test modules of one scenario: those whose file name starts with one of its patterns."""
    modules = sorted(
        str(path.relative_to(ROOT))
        for pattern in SCENARIOS[number]["tests"]
        for path in (ROOT / SUITE).glob(f"{pattern}*.py")
    )
    if not modules:
        raise SystemExit(
            f"scenario {number} has no test module named after its patterns; run the whole suite"
        )
    return modules


def collect(figures: Path, junit: Path) -> dict[int, Scenario]:
    scenarios = {number: Scenario(number) for number in SCENARIOS}
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
        scenario = scenarios.get(int(record["scenario"]))
        if scenario is None:
            continue
        value = record["value"]
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        scenario.figures.append(f"{record['name']}: {shown} {record.get('unit', '')}".rstrip())
        test = dotted(str(record.get("test", "")))
        scenario.tests.setdefault(test, outcomes.get(test, ("failed", 0.0))[0])
    for test, (outcome, seconds) in outcomes.items():
        for number, scenario in scenarios.items():
            if any(pattern in test for pattern in SCENARIOS[number]["tests"]) or test in scenario.tests:
                scenario.tests[test] = outcome
                scenario.seconds += seconds
    return scenarios


def machine() -> str:
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    system = f"{platform.system()} {platform.release()}"
    return f"{model}, {os.cpu_count()} cores, {system}, Python {platform.python_version()}"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def merge_results(
    previous: dict[str, dict[str, Any]], scenarios: dict[int, Scenario], run: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """The results after this run: `previous` with the entry of every scenario that ran replaced."""
    results = dict(previous)
    for number, scenario in scenarios.items():
        if scenario.result == "not run":
            continue
        results[str(number)] = {
            "result": scenario.result,
            "seconds": round(scenario.seconds),
            "figures": scenario.figures,
            "failing": sorted(t for t, outcome in scenario.tests.items() if outcome != "passed"),
            "date": run["date"],
            "version": run["version"],
        }
    return results


def render(results: dict[str, dict[str, Any]], run: dict[str, Any]) -> str:
    """docs/reliability.md: `run` is this run's date, version, pytest exit code, seconds and scope."""
    rows = [
        "| # | Scenario | What was done | What must hold | Figures measured | Result |",
        "|---|---|---|---|---|---|",
    ]
    failing: list[str] = []
    for number, spec in SCENARIOS.items():
        entry = results.get(str(number))
        texts = " | ".join(cell(str(spec[key])) for key in ("title", "done", "holds"))
        if entry is None:
            rows.append(f"| {number} | {texts} | (none recorded) | not run |")
            continue
        figures = "<br>".join(cell(f) for f in entry["figures"]) or "(none recorded)"
        when = "" if entry["date"] == run["date"] else f"; {entry['version']} run of {entry['date']}"
        rows.append(f"| {number} | {texts} | {figures} | {entry['result']} ({entry['seconds']} s{when}) |")
        failing += entry["failing"]
    lines = [
        "# Reliability report",
        "",
        "Generated by `make reliability` (scripts/reliability_report.py) from the tests in",
        "tests/reliability; do not edit by hand. Each figure is measured by the scenario's tests; the",
        "bounds they assert are in their modules. A row that an earlier run recorded says when.",
        "",
        f"- Date: {run['date']}",
        f"- Machine: {machine()}",
        f"- Version: {run['version']}; {run['scope']}; pytest exit code {run['code']}; "
        f"{run['seconds']:.0f} s in all",
        "",
        *rows,
        "",
    ]
    if failing:
        lines += ["## Tests that did not pass", "", *(f"- `{test}`" for test in sorted(failing)), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where to write the report")
    parser.add_argument("--results", type=Path, default=RESULTS, help="each scenario's latest outcome")
    parser.add_argument("--quick", action="store_true", help="the short CI versions instead of the full ones")
    parser.add_argument(
        "--only", type=int, choices=sorted(SCENARIOS), help="run this scenario's modules only"
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    paths = scenario_modules(args.only) if args.only else None
    with tempfile.TemporaryDirectory(prefix="strata-reliability-") as scratch:
        figures, junit = Path(scratch) / "figures.jsonl", Path(scratch) / "junit.xml"
        code, seconds = run_suite(figures, junit, args.quick, args.pytest_args, paths)
        scenarios = collect(figures, junit)
    run = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "version": "short (CI)" if args.quick else "full",
        "scope": f"scenario {args.only} only" if args.only else "the whole suite",
        "code": code,
        "seconds": seconds,
    }
    previous = json.loads(args.results.read_text()) if args.results.exists() else {}
    results = merge_results(previous, scenarios, run)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(results, run))
    for number, scenario in scenarios.items():
        print(f"scenario {number:2}: {scenario.result}")
    print(f"wrote {args.output} and {args.results}")
    return code


if __name__ == "__main__":
    sys.exit(main())
