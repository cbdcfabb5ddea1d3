"""`strata bench --rate`'s admission promise: the 50 ms rule, misses as infinity in the percentiles and
the verdict, the split by route, and the gateway's decision histogram from two scrapes (parsed, over
HTTP, and judged). The schedule, the goodput accounting and the options are
tests/unit/test_bench_rate.py's."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest, start_http_server

from bench.admission import (
    median_with_misses,
    percentile_with_misses,
    refused_at_admission,
    route_of,
    routes_of,
)
from bench.gateway_metrics import (
    DECISION_HISTOGRAM,
    bucket_delta,
    bucket_quantile,
    decision_summary,
    merge_buckets,
    parse_decisions,
    scrape_decisions,
)
from bench.rate_phase import aggregate_phase
from bench.rate_report import judge_rate
from bench.stats import percentile
from tests.unit.bench_rate_helpers import (
    FALLBACK,
    PRIMARY,
    SLO_MS,
    entry,
    failed,
    ok,
    phase_summary,
    refused,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

# The gateway's own buckets (gateway/metrics.py's DECISION_BUCKETS).
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def test_a_refusal_is_one_within_50_ms_and_a_later_one_is_an_admitted_miss() -> None:
    quick = refused(0, "queue full: 8 requests waiting", 0.030)
    late = refused(1, "request shed under overload", 0.200)
    edge = refused(2, "queue full", 0.050)  # exactly at the bound: still a refusal at admission
    assert refused_at_admission(quick) and refused_at_admission(edge) and not refused_at_admission(late)
    # Nothing else is ever a refusal, however fast.
    assert not refused_at_admission(failed(3, "UNAVAILABLE", 0.001))
    assert not refused_at_admission(failed(4, "DEADLINE_EXCEEDED", 0.010))

    summary = phase_summary("off", [quick, late, edge, ok(3, 0.1)])
    assert (summary["offered"], summary["refused"], summary["admitted"]) == (4, 2, 2)
    assert summary["refusal_reasons"] == {"queue_full": 2}
    assert summary["refusal_decision_ms"]["p99"] == pytest.approx(30.0 + 0.99 * 20.0)  # of the two only
    primary = summary["routes"]["primary"]
    assert (primary["admitted"], primary["met_slo"], primary["no_first_token"]) == (2, 1, 1)
    assert primary["met_slo_share"] == pytest.approx(0.5)
    assert primary["ttft_ms"]["p50"] is None and primary["ttft_ms"]["p99"] is None  # [100, inf]
    assert summary["admitted_failures"] == {"RESOURCE_EXHAUSTED:shed": 1}


def test_the_window_counts_from_arrival_at_the_gateway_when_it_says_so() -> None:
    """The gateway's strata-elapsed-ms trailer, not the client's clock, decides: a refusal decided
    1 ms after arrival but seen 80 ms after the send (the client's own lag) is a refusal, counted as
    late by the client's clock; one the gateway decided 200 ms after arrival is an admitted miss."""
    lagged = refused(0, "queue full", 0.080)
    lagged.server_elapsed_s = 0.001
    slow = refused(1, "request shed", 0.210)
    slow.server_elapsed_s = 0.200
    assert refused_at_admission(lagged) and not refused_at_admission(slow)
    summary = phase_summary("off", [lagged, slow, ok(2, 0.1)])
    assert (summary["refused"], summary["refused_late_by_client_clock"], summary["admitted"]) == (1, 1, 2)


def test_misses_count_as_infinity_so_two_in_a_hundred_fail_the_p99() -> None:
    results = [ok(i, 0.1 + 0.001 * i) for i in range(98)]
    results += [failed(98, "DEADLINE_EXCEEDED", 30.0), refused(99, "shed", 0.5)]
    summary = phase_summary("on", results)
    primary = summary["routes"]["primary"]
    assert (primary["admitted"], primary["no_first_token"], primary["met_slo"]) == (100, 2, 98)
    # Of 100 sorted TTFTs the last two are infinite: p50 and p95 fall between measured ones, p99 does not.
    assert primary["ttft_ms"]["p50"] == pytest.approx(149.5) and primary["ttft_ms"]["p95"] == pytest.approx(
        194.05
    )
    assert primary["ttft_ms"]["p99"] is None
    phases = {
        "off": aggregate_phase([phase_summary("off", [ok(0, 0.1)])]),
        "on": aggregate_phase([summary]),
    }
    check = judge_rate(phases, SLO_MS)["ttft_p99"]["on"]["primary"]
    assert check == {
        "admitted": 100, "no_first_token": 2, "limit_ms": pytest.approx(1100.0), "value_ms": None,
        "value_is": "the worst round's p99", "pass": False,
    }  # fmt: skip
    # Had those two been dropped instead, the p99 would have passed: that is what the rule forbids.
    assert 1000 * percentile([r.ttft_s for r in results[:98] if r.ttft_s is not None], 99) < 1100.0


def test_percentiles_with_misses_interpolate_only_between_measured_values() -> None:
    assert percentile_with_misses([1.0, 2.0, 3.0], 0, 50) == pytest.approx(2.0)
    assert percentile_with_misses([1.0, 2.0, 3.0], 1, 50) == pytest.approx(2.5)
    assert percentile_with_misses([1.0, 2.0, 3.0], 1, 99) is None  # between 3 and infinity
    assert percentile_with_misses([], 3, 0) is None and percentile_with_misses([], 0, 50) is None
    assert percentile_with_misses([5.0], 0, 99) == pytest.approx(5.0)
    # Over rounds: a round whose p99 was a miss is an infinite round, not a round left out.
    assert median_with_misses([100.0, None, 300.0]) == pytest.approx(300.0)
    assert median_with_misses([100.0, None, None]) is None
    assert median_with_misses([100.0, 200.0, 300.0]) == pytest.approx(200.0)
    assert median_with_misses([]) is None


def test_admitted_requests_split_by_the_model_that_served_them() -> None:
    results = [
        ok(0, 0.2),
        ok(1, 0.3, model=FALLBACK, fallback_reason="primary saturated"),
        ok(2, 1.5, model="a-third-model"),  # any model but the primary is the fallback route
        failed(3, "UNAVAILABLE", 0.4),  # failed without naming a model: the primary's
        refused(4, "queue full", 0.002),  # refused at admission: no route at all
    ]
    assert [route_of(r, PRIMARY) for r in results[:4]] == ["primary", "fallback", "fallback", "primary"]
    routes = routes_of(results, PRIMARY, SLO_MS)
    assert routes["primary"]["admitted"] == 2 and routes["primary"]["met_slo"] == 1
    assert routes["primary"]["no_first_token"] == 1
    assert routes["fallback"]["admitted"] == 2 and routes["fallback"]["met_slo"] == 1
    assert routes["fallback"]["ttft_ms"]["p50"] == pytest.approx(900.0)
    assert routes["fallback"]["met_slo_share"] == pytest.approx(0.5)
    # Rounds add up per route; the p99 is the median of the rounds that admitted any on it.
    rounds = [phase_summary("on", results), phase_summary("on", [ok(0, 0.1)])]
    phase = aggregate_phase(rounds)
    fallback = phase["routes"]["fallback"]
    assert fallback["admitted"] == 2 and fallback["admitted_runs"] == [2, 0]
    assert fallback["ttft_p99_ms_runs"][1] is None
    assert fallback["ttft_ms"]["p99"] == pytest.approx(rounds[0]["routes"]["fallback"]["ttft_ms"]["p99"])
    assert phase["routes"]["primary"]["admitted"] == 3
    # A route that admitted requests is judged on its own: the fallback's 1.5 s fails the rate.
    off = aggregate_phase([phase_summary("off", [ok(0, 0.1)]) for _ in rounds])
    verdict = judge_rate({"off": off, "on": phase}, SLO_MS)
    assert verdict["ttft_p99"]["on"]["fallback"]["pass"] is False and verdict["pass"] is False


def _registry() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    histogram = Histogram(
        DECISION_HISTOGRAM, "decisions", ["model", "outcome"], buckets=BUCKETS, registry=registry
    )
    return registry, histogram


def test_the_gateway_p99_is_the_bound_of_the_bucket_holding_it_between_two_scrapes() -> None:
    registry, histogram = _registry()
    assert parse_decisions(generate_latest(registry).decode()) == {"admitted": {}, "refused": {}}
    histogram.labels(PRIMARY, "refused").observe(0.5)  # before the phase: not the phase's
    before = parse_decisions(generate_latest(registry).decode())
    for _ in range(97):
        histogram.labels(PRIMARY, "refused").observe(0.0004)
    histogram.labels(FALLBACK, "refused").observe(0.0004)  # every route adds up
    histogram.labels(PRIMARY, "refused").observe(0.003)
    histogram.labels(PRIMARY, "refused").observe(0.02)
    for _ in range(5):
        histogram.labels(PRIMARY, "admitted").observe(0.00005)
    after = parse_decisions(generate_latest(registry).decode())
    delta = bucket_delta(before, after)
    assert delta["refused"][math.inf] == 100 and delta["refused"][0.0005] == 98
    # 99 of 100 are within 5 ms (the 99th is the 3 ms one): its bucket's bound, not 3 ms.
    assert bucket_quantile(delta["refused"], 0.99) == pytest.approx(0.005)
    assert bucket_quantile(delta["refused"], 0.5) == pytest.approx(0.0005)
    summary = decision_summary(delta)
    assert summary["refused"]["count"] == 100 and summary["refused"]["p99_ms"] == pytest.approx(5.0)
    assert summary["admitted"]["count"] == 5 and summary["admitted"]["p99_ms"] == pytest.approx(0.1)
    assert summary["refused"]["buckets"]["+Inf"] == 100 and summary["refused"]["p99_over_ms"] is None
    # Two rounds of the same phase add up before the p99 is taken.
    assert decision_summary(merge_buckets([delta, delta]))["refused"]["count"] == 200
    # Past the last finite bucket the p99 has no bound: null, and the bucket it is beyond.
    slow = decision_summary({"refused": {1.0: 0.0, math.inf: 3.0}, "admitted": {}})
    assert slow["refused"]["p99_ms"] is None and slow["refused"]["p99_over_ms"] == pytest.approx(1000.0)
    assert decision_summary({"refused": {}, "admitted": {}})["refused"] == {
        "count": 0, "p99_ms": None, "p99_over_ms": None, "buckets": {},
    }  # fmt: skip
    with pytest.raises(ValueError, match="went down"):
        bucket_delta(after, before)


@pytest.fixture
def metrics() -> Iterator[tuple[str, Histogram]]:
    registry, histogram = _registry()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{server.server_port}", histogram
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_two_scrapes_over_http_give_the_phase_its_gateway_decision_and_verdict(
    metrics: tuple[str, Histogram],
) -> None:
    address, histogram = metrics
    before = asyncio.run(scrape_decisions(address))
    for seconds in (0.003, 0.004, 0.0045):
        histogram.labels(PRIMARY, "refused").observe(seconds)
    after = asyncio.run(scrape_decisions(address))
    # Goodput doubles with the fallback and every TTFT is in time: only the gateway's figure can fail.
    served = [[ok(0, 0.1)]], [[ok(0, 0.1), ok(1, 0.1)]]
    fast = entry(4.0, *served, decisions=bucket_delta(before, after))
    gateway = fast["target"]["gateway_refusal_p99"]
    assert fast["phases"]["off"]["gateway_decision"]["refused"]["p99_ms"] == pytest.approx(5.0)
    assert gateway["off"] == {
        "known": True, "count": 3, "p99_ms": pytest.approx(5.0), "p99_over_ms": None, "limit_ms": 10.0,
        "pass": True,
    }  # fmt: skip
    assert fast["target"]["gateway_refusal_pass"] is True and fast["target"]["pass"] is True
    # 7 ms lands in the (5, 10] ms bucket: its bound, 10 ms, is within the limit; 20 ms is not.
    histogram.labels(PRIMARY, "refused").observe(0.007)
    later = asyncio.run(scrape_decisions(address))
    within = entry(4.0, *served, decisions=bucket_delta(after, later))
    assert within["target"]["gateway_refusal_p99"]["on"]["p99_ms"] == pytest.approx(10.0)
    assert within["target"]["gateway_refusal_pass"] is True
    histogram.labels(PRIMARY, "refused").observe(0.02)
    slow = entry(4.0, *served, decisions=bucket_delta(later, asyncio.run(scrape_decisions(address))))
    assert slow["target"]["gateway_refusal_p99"]["on"]["p99_ms"] == pytest.approx(25.0)
    assert slow["target"]["gateway_refusal_pass"] is False and slow["target"]["pass"] is False
    # Nothing refused in between: nothing to judge, and nothing fails for it.
    idle = asyncio.run(scrape_decisions(address))
    quiet = entry(4.0, *served, decisions=bucket_delta(idle, idle))
    assert quiet["target"]["gateway_refusal_p99"]["off"]["known"] is False
    assert quiet["target"]["gateway_refusal_pass"] is True and quiet["target"]["pass"] is True
