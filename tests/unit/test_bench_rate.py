"""`strata bench --rate`: the arrival schedule, the goodput accounting, refusal reasons, the rounds and
the verdict, the record and its table, the options. The admission rule, the routes and the gateway's
histogram are tests/unit/test_bench_rate_admission.py's; the comparison and the plot
tests/unit/test_bench_rate_compare.py's; the open-loop driver, the config reads and the smoke run
tests/unit/test_bench_rate_driver.py's."""

from __future__ import annotations

import itertools
import statistics
from typing import TYPE_CHECKING, Any

import pytest

from bench.load import LevelRun, summarize_level
from bench.options import resolve
from bench.rate import arrival_offsets, arrivals_per_phase, rate_request
from bench.rate_phase import aggregate_phase, fallback_key, refusal_reason
from bench.rate_report import format_rate_report, judge_rate
from bench.stack import main
from bench.stack_prompts import Prompt
from strata.v1 import gateway_pb2
from tests.unit.bench_rate_helpers import (
    FALLBACK,
    NEW,
    PRIMARY,
    SLO_MS,
    entry,
    failed,
    ok,
    parse,
    phase_summary,
    record,
    refused,
)

if TYPE_CHECKING:
    from pathlib import Path

    from bench.driver import RequestResult

SATURATED = "primary saturated: queue full: 4 requests waiting"


def test_fixed_arrivals_are_evenly_spaced_from_zero() -> None:
    assert arrival_offsets(4.0, 5, "fixed", "s") == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_poisson_arrivals_are_seeded_with_the_asked_mean_rate() -> None:
    offsets = arrival_offsets(10.0, 20_000, "poisson", "seed")
    assert offsets[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean (a fixed interval would have none).
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.05)
    assert arrival_offsets(10.0, 50, "poisson", "seed") == offsets[:50]
    assert arrival_offsets(10.0, 50, "poisson", "other") != offsets[:50]
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(0.0, 5, "poisson", "s")
    with pytest.raises(ValueError, match="poisson or fixed"):
        arrival_offsets(1.0, 5, "bursty", "s")


def test_arrivals_per_phase_come_from_rate_and_duration_unless_given() -> None:
    assert arrivals_per_phase(7.5, 20.0, None) == 150
    assert arrivals_per_phase(0.01, 3.0, None) == 1
    assert arrivals_per_phase(7.5, 20.0, 12) == 12


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("queue full: 64 requests waiting", "queue_full"),
        ("route 'x': token budget: 40000 prompt tokens queued, limit 32768", "token_budget"),
        ("predicted time to first token 3.1 s exceeds the SLO 2.0 s", "ttft_slo"),
        ("predicted wait 4.0 s exceeds the deadline's 1.2 s", "predicted_wait"),
        ("batch request shed under overload", "shed"),
        ("every worker for model 'x' is at capacity; retry shortly", "no_credit"),
        ("reason=queue_full", "queue_full"),
        (
            "model 'p' is overloaded: no worker has reported a step yet to forecast a wait from: "
            "only requests that start at once; retry in 1.0 s",
            "ttft_slo",
        ),
        ("something else entirely", "other"),
    ],
)
def test_refusal_reasons_are_read_from_the_message(message: str, reason: str) -> None:
    assert refusal_reason(message) == reason


@pytest.mark.parametrize(
    ("reason", "key"),
    [
        (
            "primary saturated: predicted time to first token 3.1 s exceeds the SLO 2.0 s",
            "primary_saturated:ttft_slo",
        ),
        ("primary tiny unavailable: worker 127.0.0.1:5 is NOT_SERVING", "primary_unavailable"),
        ("primary failed before the first token: worker died", "primary_failed"),
        ("primary tiny failed mid-stream after 5 tokens: connection lost", "failover"),
        ("", "none given"),
    ],
)
def test_fallback_reasons_are_keyed_by_trigger(reason: str, key: str) -> None:
    assert fallback_key(reason) == key


def test_goodput_counts_only_completed_requests_within_the_slo() -> None:
    results = [
        ok(0, 0.2, itl_s=[0.01, 0.03, 0.02]),
        ok(1, 1.0),  # exactly at the SLO: met
        ok(2, 1.5),  # late: completed, but not goodput
        ok(3, 0.3, model=FALLBACK, fallback_reason=SATURATED),
        ok(4, 0.4, model=FALLBACK, fallback_reason=SATURATED, failover_at_token=2),
        ok(5, 0.5, tokens=NEW - 1),  # miscounted: completed, counted, flagged
        refused(6, "queue full: 8 requests waiting", 0.002),
        refused(7, "predicted time to first token 3.0 s exceeds the SLO 1.0 s", 0.004, hint=None),
        failed(8, "UNAVAILABLE", 0.1, "gone"),
    ]
    summary = phase_summary("on", results)
    assert summary["offered"] == 9 and summary["completed"] == 6 and summary["refused"] == 2
    assert summary["admitted"] == 7  # the UNAVAILABLE one too: it was not refused at admission
    assert summary["good_requests"] == 5
    assert summary["good_tokens"] == 4 * NEW + NEW - 1
    assert summary["goodput_tok_s"] == pytest.approx((5 * NEW - 1) / 2.0)
    assert summary["output_tok_s"] == pytest.approx((6 * NEW - 1) / 2.0)
    assert summary["refusals"] == {"RESOURCE_EXHAUSTED": 2}
    assert summary["refusal_reasons"] == {"queue_full": 1, "ttft_slo": 1}
    assert summary["refusals_with_retry_hint"] == 1
    assert summary["refusal_decision_ms"]["p50"] == pytest.approx(3.0)
    assert summary["refusal_decision_ms"]["p99"] == pytest.approx(3.98)
    assert summary["itl_ms"]["p50"] == pytest.approx(20.0) and summary["itl_ms"]["p99"] == pytest.approx(29.8)
    assert summary["gateway_decision"] is None  # not scraped
    assert summary["admitted_failures"] == {"UNAVAILABLE": 1}
    primary, fallback = summary["routes"]["primary"], summary["routes"]["fallback"]
    assert (primary["admitted"], primary["met_slo"], primary["no_first_token"]) == (5, 3, 1)
    assert primary["met_slo_share"] == pytest.approx(3 / 5)
    # [200, 500, 1000, 1500, inf]: the median is a measured value, the p99 lands past the last one.
    assert primary["ttft_ms"]["p50"] == pytest.approx(1000.0) and primary["ttft_ms"]["p99"] is None
    assert (fallback["admitted"], fallback["met_slo"], fallback["no_first_token"]) == (2, 2, 0)
    assert fallback["ttft_ms"]["p99"] == pytest.approx(300.0 + 0.99 * 100.0)
    assert summary["served_by"] == {PRIMARY: 4, FALLBACK: 2}
    assert summary["fallback_served"] == 2
    assert summary["fallback_share"] == pytest.approx(2 / 6)
    assert summary["fallback_reasons"] == {"primary_saturated:queue_full": 2}
    assert summary["fallback_reason_examples"] == ["primary saturated: queue full: 4 requests waiting"]
    assert summary["failovers"] == 1
    assert summary["errors"] == {"UNAVAILABLE": 1}
    assert summary["error_examples"] == ["UNAVAILABLE: gone"]
    assert summary["token_mismatches"] == 1
    assert summary["send_lag_ms"]["max"] == pytest.approx(5.0)


@pytest.mark.parametrize(
    "result",
    [
        ok(0, 0.1, usage_input_tokens=None, usage_output_tokens=None),  # no final message
        ok(0, 0.1, usage_input_tokens=7),  # the stack tokenized the prompt differently
        ok(0, 0.1, usage_output_tokens=NEW + 1),  # usage disagrees with the asked tokens
        ok(0, 0.1, tokens=NEW + 1),  # streamed more tokens than asked (and than usage says)
    ],
)
def test_both_loads_count_a_miscounted_request_by_the_one_token_check(result: RequestResult) -> None:
    assert phase_summary("on", [result])["token_mismatches"] == 1
    level = summarize_level(LevelRun(1, 1.0, [result]), [8], NEW)
    assert level["token_mismatches"] == 1 and level["token_mismatch_examples"][0]["request"] == 0
    counted = ok(0, 0.1)
    assert phase_summary("on", [counted])["token_mismatches"] == 0
    assert summarize_level(LevelRun(1, 1.0, [counted]), [8], NEW)["token_mismatches"] == 0


def _rounds(off_good: int, on_good: int, on_ttft_s: float) -> tuple[list[RequestResult], list[RequestResult]]:
    off = [ok(i, 0.1) for i in range(off_good)] + [refused(99, "queue full", 0.001)]
    on = [ok(i, on_ttft_s) for i in range(on_good)]
    return off, on


def _phases(*rounds: tuple[list[RequestResult], list[RequestResult]]) -> dict[str, dict[str, Any]]:
    return {
        name: aggregate_phase([phase_summary(name, pair[index], 1.0) for pair in rounds])
        for index, name in enumerate(("off", "on"))
    }


def test_rounds_reduce_to_medians_and_the_verdict_judges_ttft_goodput_and_the_gateway() -> None:
    phases = _phases(_rounds(4, 8, 0.2), _rounds(5, 6, 0.3), _rounds(4, 7, 0.25))
    off, on = phases["off"], phases["on"]
    assert off["goodput_tok_s"] == pytest.approx(4 * NEW)
    assert off["goodput_tok_s_spread"] == pytest.approx([4 * NEW, 5 * NEW])
    assert on["goodput_tok_s"] == pytest.approx(7 * NEW)
    assert off["refused"] == 3 and off["admitted"] == 13 and off["refusal_reasons"] == {"queue_full": 3}
    assert on["routes"]["primary"]["ttft_ms"]["p99"] == pytest.approx(250.0)
    assert on["routes"]["primary"]["ttft_p99_ms_runs"] == pytest.approx([200.0, 300.0, 250.0])
    assert on["routes"]["primary"]["admitted"] == 21 and on["routes"]["fallback"]["admitted"] == 0
    assert len(on["runs"]) == 3
    verdict = judge_rate(phases, SLO_MS)
    assert verdict["goodput_ratio"] == pytest.approx(7 / 4)
    assert verdict["goodput_ratio_runs"] == pytest.approx([2.0, 6 / 5, 7 / 4])
    # Only routes that admitted requests are judged: no fallback line here.
    assert set(verdict["ttft_p99"]) == {"off", "on"} and set(verdict["ttft_p99"]["on"]) == {"primary"}
    check = verdict["ttft_p99"]["on"]["primary"]
    # Judged on the worst round (300 ms), not the median of the rounds (250 ms).
    assert check["limit_ms"] == pytest.approx(1.1 * SLO_MS) and check["value_ms"] == pytest.approx(300.0)
    assert verdict["gateway_refusal_p99"]["off"]["known"] is False and verdict["gateway_refusal_pass"]
    assert verdict["goodput_pass"] is True and verdict["ttft_pass"] is True and verdict["pass"] is True

    # One round of three past the limit fails the rate, though the median round is in time.
    bad = judge_rate(_phases(_rounds(4, 8, 0.2), _rounds(4, 8, 1.5), _rounds(4, 8, 0.2)), SLO_MS)
    assert bad["ttft_p99"]["on"]["primary"]["value_ms"] == pytest.approx(1500.0)
    assert bad["ttft_pass"] is False and bad["pass"] is False

    # Within 1.1 x the SLO but past it: the TTFT check holds, yet none of it is goodput.
    slow = judge_rate(_phases(_rounds(4, 8, 1.05)), SLO_MS)
    assert slow["ttft_p99"]["on"]["primary"]["pass"] is True and slow["ttft_pass"] is True
    assert slow["goodput_ratio"] == 0.0 and slow["pass"] is False
    late = judge_rate(_phases(_rounds(4, 8, 1.2)), SLO_MS)
    assert late["ttft_p99"]["on"]["primary"]["value_ms"] == pytest.approx(1200.0)
    assert late["ttft_pass"] is False and late["pass"] is False

    nothing = _phases(([refused(0, "queue full", 0.001)], [ok(0, 0.1)]))
    unbounded = judge_rate(nothing, SLO_MS)
    assert unbounded["goodput_ratio"] is None and unbounded["goodput_pass"] is True
    assert set(unbounded["ttft_p99"]) == {"on"}  # fallback off admitted nothing


def test_the_record_is_voided_by_errors_and_by_the_fallback_serving_with_fallback_off() -> None:
    clean = record([entry(4.0, [[ok(0, 0.1), refused(1, "queue full", 0.001)]], [[ok(0, 0.1), ok(1, 0.2)]])])
    assert clean["voided"] is False and clean["invalid_reasons"] == ["--smoke run"]
    assert clean["rates"][0]["target"]["goodput_ratio"] == pytest.approx(2.0)
    assert clean["checkout"]["commit"] == "abc123" and clean["pass"] is True
    assert "network hop" in clean["notes"]["refusal_decision_ms"]
    assert "upper bound of the bucket" in clean["notes"]["gateway_decision"]
    text = format_rate_report(clean)
    assert "goodput on/off 2.00 >= 1.5: PASS" in text and "queue_full:1" in text and "rate 4.00 req/s" in text

    leaked = record(
        [entry(4.0, [[ok(0, 0.1, model=FALLBACK, fallback_reason="primary unavailable")]], [[ok(0, 0.1)]])]
    )
    assert leaked["voided"] is True
    assert any("rate 4/s, fallback off" in reason for reason in leaked["invalid_reasons"])
    broken = record([entry(4.0, [[ok(0, 0.1)]], [[ok(0, 0.1), failed(1, "INTERNAL", 0.1)]])])
    assert broken["voided"] is True and "errors {'INTERNAL': 1}" in broken["invalid_reasons"][0]


def test_the_record_holds_one_entry_per_rate_and_the_table_one_block_each() -> None:
    fast = entry(4.0, [[ok(0, 0.1), refused(1, "queue full", 0.001)]], [[ok(0, 0.1), ok(1, 0.2)]])
    # At 8/s a request of the on phase was shed after its admission, without a token: the phase's
    # p99 is infinite (a late refusal is no error: the record stays valid).
    slow = entry(8.0, [[ok(0, 0.1)]], [[ok(0, 0.1), refused(1, "request shed under overload", 0.2)]])
    both = record([fast, slow])
    assert [e["rate_rps"] for e in both["rates"]] == [4.0, 8.0]
    assert {"rate_rps", "rate_source", "arrivals_per_phase", "schedule_s", "phases", "target"} <= set(
        both["rates"][0]
    )
    assert "rate_rps" not in both["workload"] and both["capacity"] is None
    assert both["rates"][0]["target"]["pass"] is True and both["rates"][1]["target"]["pass"] is False
    assert both["pass"] is False and both["voided"] is False
    assert both["rates"][1]["phases"]["on"]["admitted_failures"] == {"RESOURCE_EXHAUSTED:shed": 1}
    text = format_rate_report(both)
    assert text.count("  admitted TTFT p99") == 2 and "rate 8.00 req/s" in text
    assert " inf/-" in text  # the on phase at 8/s: primary p99 lands on a miss, no fallback
    assert text.rstrip().endswith("not a valid result: --smoke run") and "all rates: FAIL" in text


def test_rate_options_take_open_loop_defaults_and_refuse_closed_loop_ones(tmp_path: Path) -> None:
    args = parse("--rate", "auto")
    assert resolve(args) is None
    assert args.rate == "auto"
    assert (args.prompt_tokens, args.new_tokens, args.runs, args.duration, args.gap) == (32, 32, 3, 20.0, 3.0)
    assert args.arrival == "poisson" and args.rate_factor == 2.0 and args.ttft_slo_ms is None
    assert args.gateway_metrics is None
    args = parse("--rate", "12.5", "--smoke", "--arrival", "fixed", "--json", str(tmp_path / "x.json"))
    assert resolve(args) is None
    assert args.rate == (12.5,) and args.runs == 1 and args.plot == tmp_path / "x.png"
    for argv in (("--engine-baseline",), ("--concurrency", "1,8"), ("--requests-per-level", "4")):
        problem = resolve(parse("--rate", "3", *argv))
        assert problem is not None and problem.startswith("--rate is an open loop"), argv
    for argv, problem in (
        (("--runs", "2"), "--runs 2: at least 3 rounds (median and spread); --smoke allows 1"),
        (("--arrivals", "0"), "--arrivals 0 must be >= 1"),
        (("--ttft-slo-ms", "0"), "--ttft-slo-ms 0.0 must be > 0"),
        (("--duration", "-2"), "--duration -2.0 must be > 0"),
        (("--gap", "-1"), "--gap -1.0 must be >= 0"),
        (("--warmup-requests", "-1"), "--warmup-requests -1 must be >= 0"),
    ):
        assert resolve(parse("--rate", "3", *argv)) == problem, argv
    for argv, problem in (
        (("--capacity-requests", "0"), "--capacity-requests 0 must be >= 1"),
        (("--rate-factor", "0"), "--rate-factor 0.0 must be > 0"),
    ):
        assert resolve(parse("--rate", "auto", *argv)) == problem, argv
    # What only the closed loop checks does not apply to the open loop.
    assert resolve(parse("--rate", "3", "--ttft-requests", "0")) is None
    assert main(["--rate", "3", "--engine-baseline"]) == 2


def test_a_comma_list_of_rates_keeps_its_order_and_refuses_what_is_no_rate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse("--rate", "14,28").rate == (14.0, 28.0)
    assert parse("--rate", "28, 14,0.5").rate == (28.0, 14.0, 0.5)  # the order given: run in turn
    assert parse("--rate", "7").rate == (7.0,)
    for bad, said in (
        ("0", "0 is no rate"),
        ("-1", "-1 is no rate"),
        ("14,0", "0 is no rate"),
        ("inf", "inf is no rate"),
        ("nan", "nan is no rate"),
        ("fast", "is not a rate"),
        ("auto,14", "is not a rate"),
        ("14,,28", "has an empty rate"),
        ("14,", "has an empty rate"),
        ("14,28,14", "names a rate twice"),
    ):
        with pytest.raises(SystemExit):
            parse("--rate", bad)
        assert said in capsys.readouterr().err, bad
    # The capacity run's options belong to --rate auto: a fixed list has no capacity run.
    for argv in (("--rate-factor", "3"), ("--capacity-concurrency", "4"), ("--capacity-requests", "8")):
        problem = resolve(parse("--rate", "14,28", *argv))
        assert problem is not None and "only --rate auto measures the capacity" in problem, argv
    spawned = resolve(parse("--rate", "14", "--spawn", "--gateway-metrics", "127.0.0.1:9464"))
    assert spawned is not None and "--spawn reads its own" in spawned
    assert parse("--rate", "14", "--gateway-metrics", "127.0.0.1:9464").gateway_metrics == "127.0.0.1:9464"
    with pytest.raises(SystemExit):
        parse("--rate", "14", "--gateway-metrics", "localhost")
    assert "is not HOST:PORT" in capsys.readouterr().err


def test_requests_say_whether_the_fallback_may_serve_them() -> None:
    prompt = Prompt("some words", (1, 2))
    off = rate_request(prompt, NEW, "r-off", PRIMARY, fallback=False)
    on = rate_request(prompt, NEW, "r-on", PRIMARY, fallback=True)
    assert (off.no_fallback, off.allow_fallback) == (True, False)
    assert (on.no_fallback, on.allow_fallback) == (False, True)
    for request in (off, on):
        assert request.priority == gateway_pb2.PRIORITY_INTERACTIVE
        assert request.sampling.ignore_eos and request.sampling.temperature == 0.0
        assert request.sampling.max_new_tokens == NEW and request.model == PRIMARY
