"""The arithmetic of the tracing-overhead benchmark: a run's figures, their reduction, verdict and table.

A run is one fresh stack with tracing on (sampling 1.0) or off, measured over one window: the CPU
time (user + system) each of its processes used, the requests sent, how they ended, and the spans
the in-process receiver got meanwhile. Per mode the CPU-seconds per request are reduced to a median
and a min-max (bench/README.md's rule 6), and the median on/off ratio is judged against the target.
This module must not start stacks, send requests nor read clocks (bench/trace_overhead.py does).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

MODES = ("off", "on")
# Tracing at sampling 1.0 may cost at most this much CPU per request, the whole stack over.
TARGET_RATIO = 1.05
MIN_RUNS = 3


@dataclass(frozen=True)
class RunResult:
    """One run's window: what the stack's processes used, what the requests did, what spans came."""

    mode: str
    """"off" or "on"."""
    index: int
    requests: int
    completed: int
    failures: dict[str, int]
    """Requests that did not finish OK, by gRPC status code (refusals included)."""
    token_mismatches: int
    cpu_s: dict[str, float]
    """CPU seconds (user + system) of each stack process over the window, by service name."""
    window_s: float
    """Wall seconds of the window: the load, then the settle time."""
    load_wall_s: float
    spans: int = 0
    """Spans received during the window (and the bounded wait after it, see late_spans)."""
    late_spans: int = 0
    """Of those, the ones that came after the window closed: their export's CPU was not counted."""
    span_names: dict[str, int] = field(default_factory=dict)
    """Spans received by "service/name"."""

    @property
    def cpu_s_total(self) -> float:
        return sum(self.cpu_s.values())

    @property
    def cpu_s_per_request(self) -> float:
        return self.cpu_s_total / self.requests

    @property
    def spans_per_request(self) -> float:
        return self.spans / self.requests


def run_problems(run: RunResult, expected_requests: int) -> list[str]:
    """Why a run's numbers do not count; empty when they do."""
    where = f"run {run.index + 1} tracing {run.mode}"
    problems = []
    if run.requests != expected_requests:
        problems.append(f"{where}: sent {run.requests} requests, not {expected_requests}")
    if run.completed != run.requests:
        problems.append(f"{where}: {run.requests - run.completed} requests failed ({_counts(run.failures)})")
    if run.token_mismatches:
        problems.append(f"{where}: {run.token_mismatches} requests miscounted tokens")
    if run.mode == "on" and run.spans < run.requests:
        problems.append(
            f"{where}: the receiver got {run.spans} spans for {run.requests} requests "
            "(tracing on must give at least one per request)"
        )
    if run.mode == "off" and run.spans:
        problems.append(f"{where}: tracing off, yet the receiver got {run.spans} spans")
    return problems


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def summarize_mode(runs: list[RunResult]) -> dict[str, Any]:
    """One mode's runs: CPU-s/request median, spread and values, the per-process medians, spans."""
    if not runs:
        raise ValueError("summarize_mode needs at least one run")
    per_request = [run.cpu_s_per_request for run in runs]
    names = sorted({name for run in runs for name in run.cpu_s})
    return {
        "runs": len(runs),
        "cpu_s_per_request": _median(per_request),
        "cpu_s_per_request_spread": [min(per_request), max(per_request)],
        "cpu_s_per_request_runs": per_request,
        "per_process_cpu_s_per_request": {
            name: _median([run.cpu_s.get(name, 0.0) / run.requests for run in runs]) for name in names
        },
        "spans_per_request": _median([run.spans_per_request for run in runs]),
        "late_spans": sum(run.late_spans for run in runs),
        "load_wall_s": _median([run.load_wall_s for run in runs]),
        "window_s": _median([run.window_s for run in runs]),
    }


def judge(off: dict[str, Any], on: dict[str, Any], target: float = TARGET_RATIO) -> dict[str, Any]:
    """The median on/off ratio against the target, and the ratio of each alternating pair."""
    ratio = on["cpu_s_per_request"] / off["cpu_s_per_request"]
    pairs = [a / b for a, b in zip(on["cpu_s_per_request_runs"], off["cpu_s_per_request_runs"], strict=False)]
    return {
        "cpu_ratio_on_off": ratio,
        "cpu_ratio_on_off_pairs": pairs,
        "cpu_ratio_max": target,
        "pass": ratio <= target,
    }


def build_record(
    runs: list[RunResult],
    *,
    expected_requests: int,
    smoke: bool,
    provenance: dict[str, Any],
    config: dict[str, Any],
) -> dict[str, Any]:
    """The JSON record: per-mode summaries, the verdict, every run, validity and why not.

    `voided`: a run failed its checks (failed requests, miscounted tokens, a traced run without spans),
    so its numbers mean nothing; a record is also not `valid` with too few runs or from --smoke.
    """
    by_mode = {mode: [run for run in runs if run.mode == mode] for mode in MODES}
    problems = [problem for run in runs for problem in run_problems(run, expected_requests)]
    reasons = list(problems)
    for mode, mode_runs in by_mode.items():
        if len(mode_runs) < MIN_RUNS:
            reasons.append(f"{len(mode_runs)} runs with tracing {mode}: at least {MIN_RUNS} count")
    if smoke:
        reasons.append("--smoke run")
    record: dict[str, Any] = {
        "benchmark": "trace-overhead",
        "metric": "CPU seconds (user + system) of every stack process per request",
        "valid": not reasons,
        "voided": bool(problems),
        "invalid_reasons": reasons,
        "smoke": smoke,
        "modes": {mode: summarize_mode(mode_runs) for mode, mode_runs in by_mode.items() if mode_runs},
        "runs": [{**asdict(run), "cpu_s_per_request": run.cpu_s_per_request} for run in runs],
        "provenance": provenance,
        "config": config,
    }
    if all(by_mode.values()):
        record["target"] = judge(record["modes"]["off"], record["modes"]["on"])
    return record


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} x{value}" for key, value in sorted(counts.items())) or "none"


def format_report(record: dict[str, Any]) -> str:
    """One line per mode (median, spread, per process, spans per request), then the verdict."""
    modes = record["modes"]
    names = sorted({name for mode in modes.values() for name in mode["per_process_cpu_s_per_request"]})
    header = f"{'tracing':>7} {'CPU ms/req':>10} {'(min-max)':>15} {'spans/req':>9}"
    lines = [header + "".join(f" {name:>10}" for name in names)]
    for mode_name, mode in modes.items():
        low, high = (1000 * value for value in mode["cpu_s_per_request_spread"])
        per_process = mode["per_process_cpu_s_per_request"]
        lines.append(
            f"{mode_name:>7} {1000 * mode['cpu_s_per_request']:>10.2f} {f'{low:.2f}-{high:.2f}':>15} "
            f"{mode['spans_per_request']:>9.2f}"
            + "".join(f" {1000 * per_process.get(name, 0.0):>10.2f}" for name in names)
        )
    target = record.get("target")
    if target is not None:
        pairs = ", ".join(f"{ratio:.3f}" for ratio in target["cpu_ratio_on_off_pairs"])
        lines.append(
            f"CPU per request on/off: {target['cpu_ratio_on_off']:.3f} "
            f"(target <= {target['cpu_ratio_max']}): "
            f"{'PASS' if target['pass'] else 'FAIL'}; pairs: {pairs}"
        )
    late = modes.get("on", {}).get("late_spans", 0)
    if late:
        lines.append(f"{late} spans came after their window closed: raise --settle-s")
    if record["invalid_reasons"]:
        lines.append("not a valid result: " + "; ".join(record["invalid_reasons"]))
    return "\n".join(lines)
