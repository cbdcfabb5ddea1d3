"""The gateway's own admission decision time, read from its Prometheus endpoint around a phase.

The gateway observes `strata_gateway_admission_decision_seconds` (a histogram by model and outcome,
admitted or refused) each time a route decides whether a request joins its queue. `scrape_decisions`
reads its /metrics page over HTTP (text format, prometheus_client's parser) and adds the buckets of
every model up per outcome; `bucket_delta` is what happened between two scrapes, `merge_buckets` adds
such deltas up, and `decision_summary` gives a count and a p99 per outcome. A histogram keeps only
its buckets, so the p99 is the upper bound of the bucket holding the 99th percentile (Prometheus'
rule: the first bucket whose cumulative count reaches 0.99 of the total), never an interpolation.
This module reads one histogram; it must not send generation requests nor shape the record
(bench/rate_phase.py and bench/rate_report.py do).
"""

from __future__ import annotations

import asyncio
import math
import urllib.request
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from collections.abc import Iterable

DECISION_HISTOGRAM = "strata_gateway_admission_decision_seconds"
OUTCOMES = ("admitted", "refused")
SCRAPE_TIMEOUT_S = 10.0

# One outcome's buckets: upper bound in seconds (math.inf for +Inf) -> cumulative count.
Buckets = dict[float, float]


def parse_decisions(text: str) -> dict[str, Buckets]:
    """The histogram's cumulative buckets per outcome, every model added up (empty before any decision)."""
    histograms: dict[str, Buckets] = {outcome: {} for outcome in OUTCOMES}
    for family in text_string_to_metric_families(text):
        if family.name != DECISION_HISTOGRAM:
            continue
        for sample in family.samples:
            outcome = sample.labels.get("outcome", "")
            if sample.name.endswith("_bucket") and outcome in histograms:
                bound = float(sample.labels["le"])
                histograms[outcome][bound] = histograms[outcome].get(bound, 0.0) + sample.value
    return histograms


def fetch_metrics(address: str) -> str:
    """The /metrics page of the service at host:port, as text (blocking)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
        body: bytes = response.read()
    return body.decode()


async def scrape_decisions(address: str) -> dict[str, Buckets]:
    """One scrape of the gateway's /metrics at host:port (off the event loop: urllib blocks)."""
    return parse_decisions(await asyncio.to_thread(fetch_metrics, address))


def bucket_delta(before: dict[str, Buckets], after: dict[str, Buckets]) -> dict[str, Buckets]:
    """What each bucket gained between two scrapes; a bucket that shrank means the gateway restarted."""
    delta: dict[str, Buckets] = {}
    for outcome in OUTCOMES:
        old, new = before.get(outcome, {}), after.get(outcome, {})
        gained = {bound: new.get(bound, 0.0) - old.get(bound, 0.0) for bound in sorted({*old, *new})}
        if any(count < 0 for count in gained.values()):
            raise ValueError(f"{DECISION_HISTOGRAM}{{outcome={outcome!r}}} went down between two scrapes")
        delta[outcome] = gained
    return delta


def merge_buckets(deltas: Iterable[dict[str, Buckets]]) -> dict[str, Buckets]:
    """Several deltas (the rounds of a phase) added up bucket by bucket."""
    total: dict[str, Buckets] = {outcome: {} for outcome in OUTCOMES}
    for delta in deltas:
        for outcome, buckets in delta.items():
            for bound, count in buckets.items():
                total[outcome][bound] = total[outcome].get(bound, 0.0) + count
    return total


def bucket_quantile(buckets: Buckets, q: float) -> float | None:
    """The upper bound (s) of the first bucket whose cumulative count reaches q (0-1) of the total:
    math.inf when that is the +Inf bucket, None when the buckets counted nothing."""
    total = buckets.get(math.inf, max(buckets.values(), default=0.0))
    if total <= 0:
        return None
    rank = q * total
    return next((bound for bound in sorted(buckets) if buckets[bound] >= rank), math.inf)


def _bound_text(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


def decision_summary(delta: dict[str, Buckets]) -> dict[str, dict[str, Any]]:
    """Per outcome: count, p99 as the bucket's upper bound in ms (None past the last finite bucket,
    then `p99_over_ms` is that bucket's bound), and the cumulative buckets keyed by their `le`."""
    summary: dict[str, dict[str, Any]] = {}
    for outcome in OUTCOMES:
        buckets = delta.get(outcome, {})
        p99 = bucket_quantile(buckets, 0.99)
        finite = [bound for bound in buckets if not math.isinf(bound)]
        overflow = p99 is not None and math.isinf(p99)
        summary[outcome] = {
            "count": int(buckets.get(math.inf, 0.0)),
            "p99_ms": None if p99 is None or overflow else 1000.0 * p99,
            "p99_over_ms": 1000.0 * max(finite) if overflow and finite else None,
            "buckets": {_bound_text(bound): buckets[bound] for bound in sorted(buckets)},
        }
    return summary


def summary_buckets(summary: dict[str, dict[str, Any]]) -> dict[str, Buckets]:
    """`decision_summary`'s buckets read back from a record (JSON keys are the `le` texts)."""
    return {
        outcome: {float(bound): count for bound, count in figures["buckets"].items()}
        for outcome, figures in summary.items()
    }
