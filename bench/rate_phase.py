"""One phase of `strata bench --rate` reduced to figures: per round, then over the rounds.

A phase is one pass of a rate's arrival schedule with fallback off (requests carry no_fallback) or
on (allow_fallback). Per round: goodput (output tokens/s of the completed requests whose time to
first token met the SLO, over the phase's wall time from the first send to the last answer);
offered, admitted and refused requests by bench/admission.py's 50 ms rule; per route (primary,
fallback) the admitted requests' TTFT percentiles with misses as infinity and the share meeting the
SLO; the inter-token latency over the gaps of admitted completed requests; refusals at admission by
status code and by the reason their message names, and how long the client waited for them (send
-> RESOURCE_EXHAUSTED, network hop included); the gateway's own decision time from its histogram
(bench/gateway_metrics.py), when its metrics were scraped; who served the requests
(GenerateResponse.model, fallback_reason), what ended the admitted ones that did not complete, and
errors. The rounds reduce to medians and spreads, counts added up. This module only shapes what was
measured; it must not measure, nor talk to the stack.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import TYPE_CHECKING, Any

from bench.admission import (
    ROUTES,
    aggregate_route,
    met_slo,
    refused_at_admission,
    refused_late_by_client_clock,
    routes_of,
)
from bench.gateway_metrics import decision_summary, merge_buckets, summary_buckets
from bench.stats import percentile, summarize
from bench.summary import (
    REFUSAL_CODE,
    check_tokens,
    latency_percentiles,
    median_latencies,
    summed_counts,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from bench.driver import RequestResult
    from bench.gateway_metrics import Buckets

PHASES = ("off", "on")
# Per-round counts that add up over the rounds.
_COUNTS = (
    "offered",
    "admitted",
    "completed",
    "refused",
    "refused_late_by_client_clock",
    "good_requests",
    "fallback_served",
    "failovers",
    "token_mismatches",
)
_SUMMED = ("refusals", "refusal_reasons", "served_by", "errors", "fallback_reasons", "admitted_failures")
# The gateway's refusal messages name their reason in words; the first matching pattern wins, so the
# specific ones come before the generic ("predicted time to first token ... exceeds the deadline").
_REASON_PATTERNS = (
    ("queue_full", re.compile(r"queue[ _]full", re.IGNORECASE)),
    ("token_budget", re.compile(r"token[ _]budget", re.IGNORECASE)),
    # The gateway counts a cold start's refusal (no step reported to forecast from) as ttft_slo too.
    ("ttft_slo", re.compile(r"ttft|time to first token|\bslo\b|reported a step yet", re.IGNORECASE)),
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


def admitted_outcome(result: RequestResult) -> str:
    """What ended an admitted request that did not complete: its code (and a refusal's reason)."""
    if result.status == REFUSAL_CODE:
        return f"{REFUSAL_CODE}:{refusal_reason(result.message)}"
    return result.status


def summarize_phase(
    results: Sequence[RequestResult],
    *,
    phase: str,
    wall_s: float,
    input_tokens: Sequence[int],
    new_tokens: int,
    slo_ms: float,
    primary: str,
    decisions: dict[str, Buckets] | None = None,
) -> dict[str, Any]:
    """One phase of one round; `decisions`: the gateway's histogram delta over it (None: not scraped)."""
    ok = [r for r in results if r.status == "OK"]
    refused = [r for r in results if refused_at_admission(r)]
    admitted = [r for r in results if not refused_at_admission(r)]
    errors = Counter(r.status for r in results if r.status not in ("OK", REFUSAL_CODE))
    good = [r for r in ok if met_slo(r, slo_ms)]
    good_tokens = sum(len(r.token_ids) for r in good)
    by_fallback = [r for r in ok if r.model != primary]
    lags = [r.send_lag_s for r in results]
    return {
        "phase": phase,
        "offered": len(results),
        "admitted": len(admitted),
        "completed": len(ok),
        "refused": len(refused),
        "refused_late_by_client_clock": sum(refused_late_by_client_clock(r) for r in results),
        "wall_s": wall_s,
        "good_requests": len(good),
        "good_tokens": good_tokens,
        "goodput_tok_s": good_tokens / wall_s if wall_s > 0 else 0.0,
        "output_tok_s": sum(len(r.token_ids) for r in results) / wall_s if wall_s > 0 else 0.0,
        "routes": routes_of(results, primary, slo_ms),
        "itl_ms": latency_percentiles([gap for r in ok for gap in r.itl_s]),
        "refusals": {REFUSAL_CODE: len(refused)} if refused else {},
        "refusal_reasons": dict(Counter(refusal_reason(r.message) for r in refused)),
        "refusal_examples": sorted({r.message for r in refused})[:3],
        "refusals_with_retry_hint": sum(r.retry_hint_s is not None for r in refused),
        "refusal_decision_ms": latency_percentiles([r.e2e_s for r in refused]),
        "gateway_decision": decision_summary(decisions) if decisions is not None else None,
        "admitted_failures": dict(Counter(admitted_outcome(r) for r in admitted if r.status != "OK")),
        "served_by": dict(Counter(r.model or "?" for r in ok)),
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


def _gateway_decision(runs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The rounds' histogram deltas added up and summarized again; None when any round lacks one."""
    if any(run["gateway_decision"] is None for run in runs):
        return None
    return decision_summary(merge_buckets(summary_buckets(run["gateway_decision"]) for run in runs))


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
        "routes": {route: aggregate_route([run["routes"][route] for run in runs]) for route in ROUTES},
        "itl_ms": median_latencies(runs, "itl_ms"),
        "itl_p99_ms_runs": [run["itl_ms"]["p99"] for run in runs],
        "refusal_decision_ms": median_latencies(runs, "refusal_decision_ms", ("p50", "p99")),
        "gateway_decision": _gateway_decision(runs),
        **{key: sum(run[key] for run in runs) for key in _COUNTS},
        **{key: summed_counts(runs, key) for key in _SUMMED},
        "fallback_share": fallback / completed if completed else 0.0,
        "runs": runs,
    }
