"""One phase of `python -m bench.tenants` reduced to figures, per tenant and between tenants, then a
contestant's rounds reduced to medians and spreads.

Per tenant and round: offered, admitted and refused requests by bench/admission.py's 50 ms rule; the
admitted requests' TTFT percentiles with misses (no first token) as infinity; the share served
(completed / offered); goodput (output tokens/s of the completed requests whose TTFT met the SLO);
the served token cost x (prompt + output tokens of completed requests per second) and the demand
(prompt + asked tokens of every offered request per second), both over the phase's wall time from
its first send to its last answer, so a tenant served all it offered has x = demand. Between the
tenants: each one's max-min fair share of the total served cost (water-filling over the demands,
equal weights unless given), x over min(demand, fair share), and Jain's index of those
(bench/fairness.py). What voids a round is kept too: errors, miscounted tokens, another model
serving a no_fallback request. This module only shapes what was measured; it must not measure, nor
talk to the stack, nor judge (bench/tenant_report.py does).
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import TYPE_CHECKING, Any

from bench.admission import median_with_misses, met_slo, refused_at_admission, route_figures
from bench.fairness import jain_index, normalized_throughputs, water_fill
from bench.rate_phase import admitted_outcome, refusal_reason
from bench.stats import summarize
from bench.summary import REFUSAL_CODE, check_tokens, summed_counts

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from bench.driver import RequestResult

# Per-tenant counts that add up over the rounds, and counts by key that do.
_COUNTS = (
    "offered",
    "admitted",
    "refused",
    "completed",
    "good_requests",
    "fallback_served",
    "token_mismatches",
)
_SUMMED = ("refusal_reasons", "admitted_failures", "errors", "served_by")


def summarize_tenant(
    results: Sequence[RequestResult],
    *,
    prompt_tokens: int,
    new_tokens: int,
    wall_s: float,
    slo_ms: float,
    primary: str,
) -> dict[str, Any]:
    """One tenant in one round: every request's outcome, its admitted TTFT, goodput and token cost."""
    ok = [r for r in results if r.status == "OK"]
    admitted = [r for r in results if not refused_at_admission(r)]
    good = [r for r in ok if met_slo(r, slo_ms)]
    errors = Counter(r.status for r in results if r.status not in ("OK", REFUSAL_CODE))
    per_second = 1.0 / wall_s if wall_s > 0 else 0.0
    return {
        "offered": len(results),
        "admitted": len(admitted),
        "refused": len(results) - len(admitted),
        "completed": len(ok),
        "served_share": len(ok) / len(results) if results else 0.0,
        "good_requests": len(good),
        "goodput_tok_s": sum(len(r.token_ids) for r in good) * per_second,
        "served_cost_tok_s": sum(prompt_tokens + len(r.token_ids) for r in ok) * per_second,
        "demand_tok_s": len(results) * (prompt_tokens + new_tokens) * per_second,
        "admitted_ttft": route_figures(admitted, slo_ms),
        "refusal_reasons": dict(
            Counter(refusal_reason(r.message) for r in results if refused_at_admission(r))
        ),
        "admitted_failures": dict(Counter(admitted_outcome(r) for r in admitted if r.status != "OK")),
        "errors": dict(errors),
        "error_examples": sorted({f"{r.status}: {r.message}" for r in results if r.status in errors})[:3],
        "served_by": dict(Counter(r.model or "?" for r in ok)),
        "fallback_served": sum(r.model != primary for r in ok),
        "token_mismatches": sum(bool(check_tokens(r, prompt_tokens, new_tokens)) for r in ok),
    }


def fairness(
    tenants: Mapping[str, Mapping[str, Any]], weights: Sequence[float] | None = None
) -> dict[str, Any]:
    """Between the tenants of one round: fair shares of the total served cost, normalized throughputs
    and Jain's index over them (None when nothing was served)."""
    names = list(tenants)
    served = [tenants[name]["served_cost_tok_s"] for name in names]
    demands = [tenants[name]["demand_tok_s"] for name in names]
    capacity = sum(served)
    shares = water_fill(demands, capacity, weights)
    normalized = normalized_throughputs(served, demands, shares)
    known = [value for value in normalized if value is not None]
    return {
        "capacity_tok_s": capacity,
        "fair_share_tok_s": dict(zip(names, shares, strict=True)),
        "normalized": dict(zip(names, normalized, strict=True)),
        "jain_index": jain_index(known) if len(known) == len(names) else None,
    }


def summarize_round(
    tenants: Mapping[str, dict[str, Any]], *, contestant: str, round_index: int, wall_s: float
) -> dict[str, Any]:
    """One round of one contestant: each tenant's summary and the fairness between them."""
    return {
        "contestant": contestant,
        "round": round_index + 1,
        "wall_s": wall_s,
        "tenants": dict(tenants),
        "fairness": fairness(tenants),
    }


def spread_with_misses(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min and max of per-round figures where None stands for a miss (infinite): the median
    and max are None when they land on one, the min only when every round missed."""
    finite = [value for value in values if value is not None]
    return {
        "median": median_with_misses(values),
        "spread": [min(finite) if finite else None, None if len(finite) < len(values) else max(finite)],
        "runs": list(values),
    }


def _spread(values: Sequence[float]) -> dict[str, Any]:
    spread = summarize(list(values))
    return {"median": spread.median, "spread": [spread.low, spread.high], "runs": list(spread.values)}


def _flat(name: str, figures: dict[str, Any]) -> dict[str, Any]:
    """`name`, `name_spread`, `name_runs`: the record's layout for a figure over the rounds."""
    return {name: figures["median"], f"{name}_spread": figures["spread"], f"{name}_runs": figures["runs"]}


def _aggregate_tenant(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One tenant over the rounds: goodput, share and cost medians, TTFT p99 with misses, counts added up."""
    ttft_p99 = [run["admitted_ttft"]["ttft_ms"]["p99"] for run in rounds]
    return {
        **_flat("goodput_tok_s", _spread([run["goodput_tok_s"] for run in rounds])),
        **_flat("served_share", _spread([run["served_share"] for run in rounds])),
        **_flat("admitted_ttft_p99_ms", spread_with_misses(ttft_p99)),
        "served_cost_tok_s": statistics.median(run["served_cost_tok_s"] for run in rounds),
        "demand_tok_s": statistics.median(run["demand_tok_s"] for run in rounds),
        "no_first_token": sum(run["admitted_ttft"]["no_first_token"] for run in rounds),
        **{key: sum(run[key] for run in rounds) for key in _COUNTS},
        **{key: summed_counts(rounds, key) for key in _SUMMED},
    }


def aggregate_contestant(runs: Sequence[dict[str, Any]], quiet: str = "quiet") -> dict[str, Any]:
    """One contestant over its rounds: each tenant's figures, the quiet tenant's admitted TTFT p99 and
    served share again at the top, and Jain's index (a round that served nothing counts 0)."""
    tenants = {name: _aggregate_tenant([run["tenants"][name] for run in runs]) for name in runs[0]["tenants"]}
    jain = [run["fairness"]["jain_index"] for run in runs]
    figures = ("admitted_ttft_p99_ms", "served_share")
    return {
        "contestant": runs[0]["contestant"],
        **{f"quiet_{key}": tenants[quiet][key] for name in figures for key in _prefixed(name)},
        **_flat("jain_index", _spread([0.0 if value is None else value for value in jain])),
        "tenants": tenants,
        "runs": list(runs),
    }


def _prefixed(name: str) -> tuple[str, str, str]:
    return name, f"{name}_spread", f"{name}_runs"
