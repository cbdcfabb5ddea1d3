"""The gateway's admission promise as `strata bench --rate` counts it, read from what the client saw.

A request not refused within 50 ms of its send is admitted: only a RESOURCE_EXHAUSTED answer with
e2e_s <= 0.050 s is a refusal at admission; every other outcome (a later RESOURCE_EXHAUSTED such as a
shed, DEADLINE_EXCEEDED, UNAVAILABLE, any error) is admitted, and every admitted request counts toward
the SLO whatever happened later. It meets the SLO only if its first token arrived within it; one that
never got a first token is a miss, an infinite TTFT in the percentiles. JSON cannot hold infinity, so
a percentile that lands on a miss is None (the record keeps the number of misses next to it). An
admitted request's route is "primary" when the primary served it or it failed without naming a model
(GenerateResponse.model empty), "fallback" when any other model served it. This module only counts;
it must not measure, nor shape the record (bench/rate_phase.py does).
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from bench.summary import PERCENTILES, REFUSAL_CODE

if TYPE_CHECKING:
    from collections.abc import Sequence

    from bench.driver import RequestResult

ADMISSION_WINDOW_S = 0.050
ROUTES = ("primary", "fallback")


def refused_at_admission(result: RequestResult) -> bool:
    """RESOURCE_EXHAUSTED within the admission window of the request's arrival at the gateway (its
    strata-elapsed-ms trailer; the client's own clock when the gateway sent none); later ones were
    admitted first. The client's clock adds the network and both event loops' lag on shared cores."""
    if result.status != REFUSAL_CODE:
        return False
    elapsed = result.server_elapsed_s if result.server_elapsed_s is not None else result.e2e_s
    return elapsed <= ADMISSION_WINDOW_S


def refused_late_by_client_clock(result: RequestResult) -> bool:
    """Refused within the window at the gateway, but answered past it as the client measured."""
    return refused_at_admission(result) and result.e2e_s > ADMISSION_WINDOW_S


def route_of(result: RequestResult, primary: str) -> str:
    """The route: primary (served by it, or failed without naming a model), else fallback."""
    return "primary" if result.model in ("", primary) else "fallback"


def met_slo(result: RequestResult, slo_ms: float) -> bool:
    """Its first token arrived within the SLO (whatever the request's outcome after that)."""
    return result.ttft_s is not None and 1000.0 * result.ttft_s <= slo_ms


def percentile_with_misses(values: Sequence[float], misses: int, q: float) -> float | None:
    """The q-th percentile (0-100, interpolated as bench.stats.percentile) of `values` plus `misses`
    infinite ones; None when it is infinite (it lands on a miss, or between a value and a miss) or
    there is nothing to take it of."""
    ordered = [*sorted(values), *([math.inf] * misses)]
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100.0
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    fraction = position - below
    if math.isinf(ordered[below]) or (fraction > 0 and math.isinf(ordered[above])):
        return None
    return ordered[below] + (ordered[above] - ordered[below]) * fraction


def route_figures(admitted: Sequence[RequestResult], slo_ms: float) -> dict[str, Any]:
    """One route's admitted requests: how many, how many met the SLO, TTFT p50/p95/p99 in ms with
    the misses (no first token) as infinity, and the share meeting the SLO (None when none)."""
    ttfts = [1000.0 * r.ttft_s for r in admitted if r.ttft_s is not None]
    misses = len(admitted) - len(ttfts)
    met = sum(met_slo(r, slo_ms) for r in admitted)
    return {
        "admitted": len(admitted),
        "met_slo": met,
        "met_slo_share": met / len(admitted) if admitted else None,
        "no_first_token": misses,
        "ttft_ms": {f"p{q:g}": percentile_with_misses(ttfts, misses, q) for q in PERCENTILES},
    }


def routes_of(results: Sequence[RequestResult], primary: str, slo_ms: float) -> dict[str, dict[str, Any]]:
    """`route_figures` of the admitted requests, split by route."""
    admitted = [r for r in results if not refused_at_admission(r)]
    return {
        route: route_figures([r for r in admitted if route_of(r, primary) == route], slo_ms)
        for route in ROUTES
    }


def median_with_misses(values: Sequence[float | None]) -> float | None:
    """The median of per-round figures where None stands for a miss (infinite); None when infinite."""
    if not values:
        return None
    median = statistics.median([math.inf if value is None else value for value in values])
    return None if math.isinf(median) else median


def aggregate_route(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One route over the rounds: counts added up, each TTFT percentile's median over the rounds that
    admitted any (a round's None there is a miss, infinite), and every round's admitted count and p99
    (None: a miss where that round admitted any, else nothing admitted)."""
    counted = [run for run in runs if run["admitted"]]
    admitted = sum(run["admitted"] for run in runs)
    met = sum(run["met_slo"] for run in runs)
    return {
        "admitted": admitted,
        "met_slo": met,
        "met_slo_share": met / admitted if admitted else None,
        "no_first_token": sum(run["no_first_token"] for run in runs),
        "ttft_ms": {
            key: median_with_misses([run["ttft_ms"][key] for run in counted]) if counted else None
            for key in runs[0]["ttft_ms"]
        },
        "admitted_runs": [run["admitted"] for run in runs],
        "ttft_p99_ms_runs": [run["ttft_ms"]["p99"] for run in runs],
    }
