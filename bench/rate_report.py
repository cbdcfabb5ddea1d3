"""`strata bench --rate`: open-loop requests reduced to per-phase figures, the verdict, the record, the table.

A phase is one pass of the arrival schedule with fallback off (requests carry no_fallback) or on
(allow_fallback). Per phase: goodput (output tokens/s of the completed requests whose time to first
token met the SLO, over the phase's wall time from the first send to the last answer), offered,
completed and refused requests, refusals by status code and by the reason their message names, the
client-side refusal decision time (send -> RESOURCE_EXHAUSTED, network hop included), TTFT of the
accepted requests, who served them (GenerateResponse.model, fallback_reason) and errors. The rounds
reduce to medians and spreads; the verdict compares goodput on/off with the target. This module only
shapes what was measured; it must not measure, nor talk to the stack.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import TYPE_CHECKING, Any

from bench.stats import percentile, summarize
from bench.summary import (
    REFUSAL_CODE,
    check_tokens,
    counts_text,
    latency_percentiles,
    machine_at_end,
    median_latencies,
    ms_text,
    options_record,
    pair_text,
    pass_text,
    report_text,
    summed_counts,
)

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    from bench.driver import RequestResult

PHASES = ("off", "on")
# Per-round counts that add up over the rounds.
_COUNTS = (
    "offered",
    "completed",
    "refused",
    "good_requests",
    "fallback_served",
    "failovers",
    "token_mismatches",
)
# The target: fallback on gives at least this times the goodput of fallback off.
GOODPUT_RATIO_MIN = 1.5
# The gateway's refusal messages name their reason in words; the first matching pattern wins, so the
# specific ones come before the generic ("predicted time to first token ... exceeds the deadline").
_REASON_PATTERNS = (
    ("queue_full", re.compile(r"queue[ _]full", re.IGNORECASE)),
    ("token_budget", re.compile(r"token[ _]budget", re.IGNORECASE)),
    ("ttft_slo", re.compile(r"ttft|time to first token|\bslo\b", re.IGNORECASE)),
    ("predicted_wait", re.compile(r"predicted[ _]wait|deadline", re.IGNORECASE)),
    ("shed", re.compile(r"\bshed\b", re.IGNORECASE)),
    ("no_credit", re.compile(r"capacity|credit", re.IGNORECASE)),
)


def refusal_reason(message: str) -> str:
    """The reason a RESOURCE_EXHAUSTED message names, as a short key; "other" when none is recognized."""
    for reason, pattern in _REASON_PATTERNS:
        if pattern.search(message):
            return reason
    return "other"


def fallback_key(reason: str) -> str:
    """GenerateResponse.fallback_reason as the gateway's trigger (and, when saturated, what saturated)."""
    text = reason.lower()
    if "mid-stream" in text:
        return "failover"
    if "failed" in text:
        return "primary_failed"
    if "unavailable" in text:
        return "primary_unavailable"
    if "saturated" in text:
        return f"primary_saturated:{refusal_reason(reason)}"
    return "other" if reason else "none given"


def summarize_phase(
    results: Sequence[RequestResult],
    *,
    phase: str,
    wall_s: float,
    input_tokens: Sequence[int],
    new_tokens: int,
    slo_ms: float,
    primary: str,
) -> dict[str, Any]:
    """One phase of one round: goodput, refusals, TTFT of the accepted, who served them, errors."""
    ok = [r for r in results if r.status == "OK"]
    refused = [r for r in results if r.status == REFUSAL_CODE]
    errors = Counter(r.status for r in results if r.status not in ("OK", REFUSAL_CODE))
    good = [r for r in ok if r.ttft_s is not None and 1000.0 * r.ttft_s <= slo_ms]
    good_tokens = sum(len(r.token_ids) for r in good)
    served_by = Counter(r.model or "?" for r in ok)
    by_fallback = [r for r in ok if r.model != primary]
    lags = [r.send_lag_s for r in results]
    return {
        "phase": phase,
        "offered": len(results),
        "completed": len(ok),
        "refused": len(refused),
        "wall_s": wall_s,
        "good_requests": len(good),
        "good_tokens": good_tokens,
        "goodput_tok_s": good_tokens / wall_s if wall_s > 0 else 0.0,
        "output_tok_s": sum(len(r.token_ids) for r in results) / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": latency_percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "refusals": {REFUSAL_CODE: len(refused)} if refused else {},
        "refusal_reasons": dict(Counter(refusal_reason(r.message) for r in refused)),
        "refusal_examples": sorted({r.message for r in refused})[:3],
        "refusals_with_retry_hint": sum(r.retry_hint_s is not None for r in refused),
        "refusal_decision_ms": latency_percentiles([r.e2e_s for r in refused]),
        "served_by": dict(served_by),
        "fallback_served": len(by_fallback),
        "fallback_share": len(by_fallback) / len(ok) if ok else 0.0,
        "fallback_reasons": dict(Counter(fallback_key(r.fallback_reason) for r in by_fallback)),
        "fallback_reason_examples": sorted({r.fallback_reason for r in by_fallback})[:3],
        "failovers": sum(r.failover_at_token > 0 for r in ok),
        "errors": dict(errors),
        "error_examples": sorted({f"{r.status}: {r.message}" for r in results if r.status in errors})[:3],
        "token_mismatches": sum(bool(check_tokens(r, input_tokens[r.index], new_tokens)) for r in ok),
        "send_lag_ms": {
            "p50": 1000.0 * percentile(lags, 50) if lags else None,
            "p99": 1000.0 * percentile(lags, 99) if lags else None,
            "max": 1000.0 * max(lags) if lags else None,
        },
    }


def aggregate_phase(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase over the rounds: goodput median and spread, percentiles' medians, summed counts."""
    goodput = summarize([run["goodput_tok_s"] for run in runs])
    completed = sum(run["completed"] for run in runs)
    fallback = sum(run["fallback_served"] for run in runs)
    return {
        "phase": runs[0]["phase"],
        "goodput_tok_s": goodput.median,
        "goodput_tok_s_spread": [goodput.low, goodput.high],
        "goodput_tok_s_runs": list(goodput.values),
        "output_tok_s": statistics.median(run["output_tok_s"] for run in runs),
        "ttft_ms": median_latencies(runs, "ttft_ms"),
        "ttft_p99_ms_runs": [run["ttft_ms"]["p99"] for run in runs],
        "refusal_decision_ms": median_latencies(runs, "refusal_decision_ms", ("p50", "p99")),
        **{key: sum(run[key] for run in runs) for key in _COUNTS},
        **{key: summed_counts(runs, key) for key in ("refusals", "refusal_reasons", "served_by", "errors")},
        "fallback_reasons": summed_counts(runs, "fallback_reasons"),
        "fallback_share": fallback / completed if completed else 0.0,
        "runs": runs,
    }


def judge_rate(off: dict[str, Any], on: dict[str, Any], slo_ms: float) -> dict[str, Any]:
    """Goodput on/off (medians, and per round) against >= 1.5, and the ON phase's TTFT p99 against the SLO."""
    verdict: dict[str, Any] = {"goodput_ratio_min": GOODPUT_RATIO_MIN, "ttft_slo_ms": slo_ms}
    if off["goodput_tok_s"] > 0:
        verdict["goodput_ratio"] = on["goodput_tok_s"] / off["goodput_tok_s"]
        verdict["goodput_pass"] = verdict["goodput_ratio"] >= GOODPUT_RATIO_MIN
    else:  # nothing met the SLO without the fallback: any goodput with it is an unbounded gain
        verdict["goodput_ratio"] = None
        verdict["goodput_pass"] = on["goodput_tok_s"] > 0
    verdict["goodput_ratio_runs"] = [
        (b / a if a > 0 else None)
        for a, b in zip(off["goodput_tok_s_runs"], on["goodput_tok_s_runs"], strict=True)
    ]
    p99 = on["ttft_ms"]["p99"]
    verdict["ttft_p99_on_ms"] = p99
    verdict["ttft_p99_on_ms_runs"] = on["ttft_p99_ms_runs"]
    verdict["ttft_pass"] = p99 is not None and p99 <= slo_ms
    verdict["pass"] = bool(verdict["goodput_pass"] and verdict["ttft_pass"])
    return verdict


def invalid_reasons(phases: dict[str, dict[str, Any]], smoke: bool) -> tuple[list[str], list[str]]:
    """(what voids the numbers: errors, miscounted tokens, fallback use with fallback off; the rest)."""
    voiding = []
    for name, phase in phases.items():
        if phase["errors"]:
            voiding.append(f"fallback {name}: errors {phase['errors']}")
        if phase["token_mismatches"]:
            voiding.append(f"fallback {name}: {phase['token_mismatches']} requests miscounted tokens")
    if phases["off"]["fallback_served"]:
        voiding.append(f"fallback off: other models served requests {phases['off']['served_by']}")
    return voiding, (["--smoke run"] if smoke else [])


def build_rate_record(
    args: argparse.Namespace,
    *,
    stack: dict[str, Any],
    machine: dict[str, Any],
    workload: dict[str, Any],
    capacity: dict[str, Any] | None,
    phases: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The whole record; `workload` holds the resolved rate, schedule and SLO the driver used."""
    voiding, other = invalid_reasons(phases, args.smoke)
    reasons = voiding + other
    return {
        "benchmark": "strata bench --rate",
        "valid": not reasons,
        "invalid_reasons": reasons,
        "voided": bool(voiding),
        "smoke": args.smoke,
        "workload": workload,
        "capacity": capacity,
        "stack": stack,
        "phases": phases,
        "target": judge_rate(phases["off"], phases["on"], workload["ttft_slo_ms"]),
        "notes": {
            "goodput": "output tokens/s of completed requests whose TTFT <= the SLO, over the phase's "
            "wall time from its first send to its last answer",
            "refusal_decision_ms": "client-side, send -> RESOURCE_EXHAUSTED: includes the network hop "
            "and the client's own event loop",
        },
        "machine": machine_at_end(machine),
        "config": options_record(args),
    }


def format_rate_report(record: dict[str, Any]) -> str:
    """One line per phase, then the verdict."""
    workload, target = record["workload"], record["target"]
    lines = [
        f"open loop: {workload['rate_rps']:.2f} req/s ({workload['arrival']}, "
        f"{workload['arrivals_per_phase']} per phase, rate {workload['rate_source']}), "
        f"TTFT SLO {workload['ttft_slo_ms']:.0f} ms",
        f"{'fallback':>8} {'goodput':>8} {'(min-max)':>13} {'offered':>7} {'done':>5} {'refused':>7} "
        f"{'TTFT p50/p99 ms':>15} {'refusal p50/p99 ms':>18} {'by fallback':>11} {'reasons':>20} "
        f"{'errors':>7}",
    ]
    for name in PHASES:
        phase = record["phases"][name]
        low, high = phase["goodput_tok_s_spread"]
        ttft, decision = pair_text(phase["ttft_ms"]), pair_text(phase["refusal_decision_ms"])
        lines.append(
            f"{name:>8} {phase['goodput_tok_s']:>8.1f} {f'{low:.1f}-{high:.1f}':>13} {phase['offered']:>7} "
            f"{phase['completed']:>5} {phase['refused']:>7} {ttft:>15} {decision:>18} "
            f"{phase['fallback_share']:>11.0%} {counts_text(phase['refusal_reasons']):>20} "
            f"{counts_text(phase['errors']):>7}"
        )
    ratio = target["goodput_ratio"]
    shown = "unbounded (off had none)" if ratio is None else f"{ratio:.2f}"
    lines.append(
        f"goodput on/off: {shown} (target >= {target['goodput_ratio_min']}): "
        f"{pass_text(target['goodput_pass'])}; TTFT p99 with fallback on "
        f"{ms_text(target['ttft_p99_on_ms'])} ms (SLO {target['ttft_slo_ms']:.0f} ms): "
        f"{pass_text(target['ttft_pass'])}"
    )
    return report_text(lines, record)
