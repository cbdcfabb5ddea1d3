"""What the closed-loop and the open-loop reports of `strata bench` share: the token check of a request,
latency percentiles and their medians over rounds, counts summed over rounds, the record's `config`
block, and the table's cells.

The closed loop's levels (bench/load.py, bench/stack_report.py) and the open loop's phases
(bench/rate_report.py) are reduced with these, so both read a request and a round the same way. This
module only shapes what was measured; it must not measure, nor talk to the stack.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.stats import percentile

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterable, Sequence

    from bench.driver import RequestResult

# Overload answers: the stack declined the request, it did not fail. Every other code is an error.
REFUSAL_CODE = "RESOURCE_EXHAUSTED"
PERCENTILES = (50.0, 95.0, 99.0)


def check_tokens(result: RequestResult, input_tokens: int, new_tokens: int) -> list[str]:
    """How a successful request's token counts differ from the workload's; empty when they match."""
    if result.usage_output_tokens is None or result.usage_input_tokens is None:
        return ["no final message with usage"]
    problems = []
    if result.usage_input_tokens != input_tokens:
        problems.append(f"usage.input_tokens={result.usage_input_tokens}, the prompt has {input_tokens}")
    if result.usage_output_tokens != new_tokens:
        problems.append(f"usage.output_tokens={result.usage_output_tokens}, asked for {new_tokens}")
    if len(result.token_ids) != result.usage_output_tokens:
        problems.append(f"streamed {len(result.token_ids)} tokens, usage says {result.usage_output_tokens}")
    return problems


def void_reasons(where: str, figures: dict[str, Any]) -> list[str]:
    """What voids one phase's figures (`where` names it): requests that failed, or miscounted tokens."""
    reasons = []
    if figures["errors"]:
        reasons.append(f"{where}: errors {figures['errors']}")
    if figures["token_mismatches"]:
        reasons.append(f"{where}: {figures['token_mismatches']} requests miscounted tokens")
    return reasons


def latency_percentiles(seconds: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99 in milliseconds; None when nothing was measured (every request failed)."""
    return {f"p{q:g}": (1000.0 * percentile(seconds, q) if seconds else None) for q in PERCENTILES}


def median_latencies(
    runs: Sequence[dict[str, Any]], metric: str, keys: Iterable[str] | None = None
) -> dict[str, float | None]:
    """Each percentile's median over the rounds that measured it (`keys`: all the first round has)."""
    medians: dict[str, float | None] = {}
    for key in runs[0][metric].keys() if keys is None else keys:
        values = [run[metric][key] for run in runs if run[metric][key] is not None]
        medians[key] = statistics.median(values) if values else None
    return medians


def summed_counts(runs: Sequence[dict[str, Any]], key: str) -> dict[str, int]:
    """The rounds' counts by code (or reason, or model) added up."""
    total: Counter[str] = Counter()
    for run in runs:
        total.update(run[key])
    return dict(total)


def options_record(args: argparse.Namespace) -> dict[str, Any]:
    """Every resolved option, paths as text; the CLI's handler is no option."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "handler"}


def ms_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def pair_text(latencies: dict[str, float | None]) -> str:
    return f"{ms_text(latencies['p50'])}/{ms_text(latencies['p99'])}"


def counts_text(counts: dict[str, int]) -> str:
    return ",".join(f"{code}:{n}" for code, n in counts.items()) or "0"


def pass_text(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def report_text(lines: list[str], record: dict[str, Any]) -> str:
    """The table's lines, then why the record does not count, when it does not."""
    if record["invalid_reasons"]:
        lines.append("not a valid result: " + "; ".join(record["invalid_reasons"]))
    return "\n".join(lines)
