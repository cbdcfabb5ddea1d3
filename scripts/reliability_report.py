"""Run the reliability suite's full versions and write docs/reliability.md from what they measured.

`make reliability` runs this: pytest on tests/reliability and on the tests elsewhere that a scenario
names in its `run` key (the security promises of tests/integration/test_security.py), in a subprocess
with STRATA_RELIABILITY_FULL=1 and STRATA_RELIABILITY_FIGURES pointing at a scratch file, where each
test appends the figures it measures (the `figure` fixture of tests/figures.py), plus a JUnit XML
file for each test's outcome. The report is one table row per scenario: what was done, what must hold
(both written here, in SCENARIOS), the figures measured and pass or fail, and it states the run's own
date, machine and run time: docs/reliability.md is the one place these figures live, and other pages
link to it. A scenario's tests are those whose id matches one of its patterns, plus any test that
recorded a figure for it.

`--quick` runs the short versions CI runs and never writes docs/reliability.md: its report goes to
build/reliability-quick.md (git-ignored), titled as a quick run. `--only N` runs one scenario's tests
(those its `run` names, or the suite's modules named after its patterns) and replaces that
scenario's row of the existing report, saying when it ran alone; the rest stays as the last whole
run wrote it (`make chaos` is `--only 11`). This module must not judge a figure: the tests assert;
the report only shows what they measured.
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

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "reliability.md"
QUICK_OUTPUT = ROOT / "build" / "reliability-quick.md"
SUITE = "tests/reliability"
FIGURES_ENV = "STRATA_RELIABILITY_FIGURES"
"""Read by the `figure` fixture (tests/figures.py)."""

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
        "done": "Requests with 0.5, 1 and 2 s deadlines against 40 s generations (0.2 s engine steps, "
        "test-mode delay); streams cancelled after 3 tokens, alone and next to another request.",
        "holds": "DEADLINE_EXCEEDED at the deadline; the worker frees the KV blocks within one engine "
        "step of the cancel (<= 1 step alone, <= 2 with another request, as GetWorkerStats shows it; "
        "in time, under 5x those steps).",
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
        "done": "A client with a 1 KiB HTTP/2 window reads the first message of a 3,000-token stream "
        "(60 s at the least: 0.02 s test-mode delay per step) and then nothing; stream_idle_timeout_s "
        "is 1 s.",
        "holds": "The gateway does not buffer without bound nor hold KV blocks forever: the idle "
        "timeout cancels the request (CANCELLED, naming stream_idle_timeout_s) and the worker frees its "
        "KV blocks within 25 s of the last read (5x the expected 5 s), long before its natural end.",
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
        "failover_at_token and the fallback's greedy continuation after it (parity rule at near ties; "
        "the full run's int8 fallback, whose greedy output depends on its batch, within 8 logits of its "
        "top pick); failures end UNAVAILABLE, RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED (or the client "
        "cancelled), at most 1 s past their deadline; SDK retries rescue some; after each fault fully "
        "serving within 10 s plus the slowest restart measured, one restart per kill or SIGTERM; worker "
        "and gateway state back exactly to idle; RSS growth at most 5% (CI: 10%) after a warm baseline.",
        "tests": ("test_s11_",),
    },
    12: {
        "title": "Scale-out: one of two replicas killed",
        "done": "Two worker processes of one model behind one DNS name (as a Kubernetes headless "
        "Service resolves to its pods); 6 clients stream 24-token greedy requests; SIGKILL of one "
        "replica while they stream.",
        "holds": "No request fails, before its first token or mid-stream; a stream cut by the kill "
        "continues on the survivor token for token (its tokens equal the greedy reference); the "
        "survivor takes the traffic.",
        "tests": ("test_scale_out",),
    },
    13: {
        "title": "No API key or a wrong one",
        "done": "Generate over TLS to a gateway with API keys (one in its settings, one in a keys "
        "file): with no key, an empty key, a wrong key and a configured key plus one character; then "
        "with each configured key.",
        "holds": "Every request without a configured key is answered UNAUTHENTICATED, naming the "
        "`authorization: Bearer` header; each configured key is served.",
        "tests": ("test_security.test_a_missing_or_wrong_key", "test_security.test_a_client_with_a_key"),
        "run": (
            "tests/integration/test_security.py::test_a_missing_or_wrong_key_is_unauthenticated",
            "tests/integration/test_security.py::test_a_client_with_a_key_is_served_over_tls_end_to_end",
        ),
    },
    14: {
        "title": "No client certificate or a rogue one",
        "done": "Calls to the worker's and the tokenizer service's mutual-TLS ports with no client "
        "certificate, with a self-signed rogue one, and with the gateway's, signed by the CA.",
        "holds": "Without a certificate from the CA the TLS handshake is refused (UNAVAILABLE); the "
        "CA-signed certificate is served.",
        "tests": ("test_security.test_only_a_certificate",),
        "run": (
            "tests/integration/test_security.py::"
            "test_only_a_certificate_from_the_ca_reaches_the_internal_services",
        ),
    },
    15: {
        "title": "Plaintext on the TLS ports",
        "done": "A plaintext health check to the main (TLS) port of the gateway, the worker and the "
        "tokenizer service; a health check over TLS with no key to the gateway; plaintext liveness "
        "checks to the worker's and the tokenizer's health-only ports.",
        "holds": "Plaintext reaches no TLS port (UNAVAILABLE); health over TLS needs no key; only the "
        "health-only ports answer plaintext.",
        "tests": ("test_security.test_health_needs_no_key",),
        "run": (
            "tests/integration/test_security.py::"
            "test_health_needs_no_key_and_plaintext_reaches_nothing_but_the_health_ports",
        ),
    },
    16: {
        "title": "A service killed under strata up",
        "done": "Through the real `strata up`: kill -9 of the worker, the tokenizer and the gateway of a "
        "tiny stack; on the default model and its int8 fallback, kill -9 of the primary worker, then "
        "of the tokenizer, sending one short request after another until each is served again.",
        "holds": "Each killed service is started again on the address the others know and serves; the "
        "gateway uses a restarted worker without a restart of its own; on the default model the "
        "fallback serves within 1 s of the primary's kill and the primary again within 60 s, and "
        "requests succeed within 10 s of the tokenizer's kill (bounds asserted: 5x).",
        "tests": ("test_supervision",),
        "run": ("tests/integration/test_supervision.py",),
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


def render(collected: Collected, code: int, seconds: float, quick: bool) -> str:
    scenarios = collected.scenarios
    version = "short (CI)" if quick else "full"
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
        f"- Machine: {machine()}",
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
    with tempfile.TemporaryDirectory(prefix="strata-reliability-") as scratch:
        figures, junit = Path(scratch) / "figures.jsonl", Path(scratch) / "junit.xml"
        code, seconds = run_suite(figures, junit, args.quick, args.pytest_args, paths)
        collected = collect(figures, junit)
    output.parent.mkdir(parents=True, exist_ok=True)
    if args.only:
        scenario = collected.scenarios[args.only]
        when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        output.write_text(replace_row(output.read_text(), scenario, f"; run alone on {when}"))
        print(f"scenario {args.only:2}: {scenario.result}")
    else:
        output.write_text(render(collected, code, seconds, args.quick))
        for number, scenario in collected.scenarios.items():
            print(f"scenario {number:2}: {scenario.result}")
    print(f"wrote {output}")
    return code


if __name__ == "__main__":
    sys.exit(main())
