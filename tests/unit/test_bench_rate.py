"""`strata bench --rate`: the arrival schedule, the goodput accounting, refusal reasons, the verdict, the
options and the plot. The open-loop driver, the config reads and the smoke run are
tests/unit/test_bench_rate_driver.py's."""

from __future__ import annotations

import argparse
import itertools
import statistics
from typing import TYPE_CHECKING, Any

import pytest

from bench.driver import RequestResult
from bench.load import LevelRun, summarize_level
from bench.options import resolve
from bench.plots import write_rate_plot
from bench.rate import arrival_offsets, arrivals_per_phase, rate_request
from bench.rate_report import (
    aggregate_phase,
    build_rate_record,
    fallback_key,
    format_rate_report,
    judge_rate,
    refusal_reason,
)
from bench.stack import add_arguments, main
from bench.stack_prompts import Prompt
from strata.v1 import gateway_pb2
from tests.unit.bench_rate_helpers import FALLBACK, NEW, PRIMARY, SLO_MS, phase_summary

if TYPE_CHECKING:
    from pathlib import Path

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


def _ok(index: int, ttft_s: float, model: str = PRIMARY, tokens: int = NEW, **extra: Any) -> RequestResult:
    fields: dict[str, Any] = {"usage_input_tokens": 8, "usage_output_tokens": NEW, **extra}
    return RequestResult(
        index=index, send_lag_s=0.001 * index, status="OK", ttft_s=ttft_s, e2e_s=ttft_s + 0.1,
        token_ids=list(range(tokens)), model=model, **fields,
    )  # fmt: skip


def _refused(index: int, message: str, decision_s: float, hint: float | None = 1.0) -> RequestResult:
    return RequestResult(
        index=index, send_lag_s=0.0, status="RESOURCE_EXHAUSTED", ttft_s=None, e2e_s=decision_s,
        message=message, retry_hint_s=hint,
    )  # fmt: skip


def test_goodput_counts_only_completed_requests_within_the_slo() -> None:
    results = [
        _ok(0, 0.2),
        _ok(1, 1.0),  # exactly at the SLO: met
        _ok(2, 1.5),  # late: completed, but not goodput
        _ok(3, 0.3, model=FALLBACK, fallback_reason=SATURATED),
        _ok(4, 0.4, model=FALLBACK, fallback_reason=SATURATED, failover_at_token=2),
        _ok(5, 0.5, tokens=NEW - 1),  # miscounted: completed, counted, flagged
        _refused(6, "queue full: 8 requests waiting", 0.002),
        _refused(7, "predicted time to first token 3.0 s exceeds the SLO 1.0 s", 0.004, hint=None),
        RequestResult(index=8, send_lag_s=0.0, status="UNAVAILABLE", ttft_s=None, e2e_s=0.1, message="gone"),
    ]
    summary = phase_summary("on", results)
    assert summary["offered"] == 9 and summary["completed"] == 6 and summary["refused"] == 2
    assert summary["good_requests"] == 5
    assert summary["good_tokens"] == 4 * NEW + NEW - 1
    assert summary["goodput_tok_s"] == pytest.approx((5 * NEW - 1) / 2.0)
    assert summary["output_tok_s"] == pytest.approx((6 * NEW - 1) / 2.0)
    assert summary["refusals"] == {"RESOURCE_EXHAUSTED": 2}
    assert summary["refusal_reasons"] == {"queue_full": 1, "ttft_slo": 1}
    assert summary["refusals_with_retry_hint"] == 1
    assert summary["refusal_decision_ms"]["p50"] == pytest.approx(3.0)
    assert summary["refusal_decision_ms"]["p99"] == pytest.approx(3.98)
    assert summary["ttft_ms"]["p99"] == pytest.approx(1000 * (1.0 + 0.95 * 0.5))
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
        _ok(0, 0.1, usage_input_tokens=None, usage_output_tokens=None),  # no final message
        _ok(0, 0.1, usage_input_tokens=7),  # the stack tokenized the prompt differently
        _ok(0, 0.1, usage_output_tokens=NEW + 1),  # usage disagrees with the asked tokens
        _ok(0, 0.1, tokens=NEW + 1),  # streamed more tokens than asked (and than usage says)
    ],
)
def test_both_loads_count_a_miscounted_request_by_the_one_token_check(result: RequestResult) -> None:
    assert phase_summary("on", [result])["token_mismatches"] == 1
    level = summarize_level(LevelRun(1, 1.0, [result]), [8], NEW)
    assert level["token_mismatches"] == 1 and level["token_mismatch_examples"][0]["request"] == 0
    counted = _ok(0, 0.1)
    assert phase_summary("on", [counted])["token_mismatches"] == 0
    assert summarize_level(LevelRun(1, 1.0, [counted]), [8], NEW)["token_mismatches"] == 0


def _round(off_tokens: int, on_tokens: int, on_ttft_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    off = [_ok(i, 0.1) for i in range(off_tokens)] + [_refused(99, "queue full", 0.001)]
    on = [_ok(i, on_ttft_s) for i in range(on_tokens)]
    return phase_summary("off", off, 1.0), phase_summary("on", on, 1.0)


def test_rounds_reduce_to_medians_and_the_verdict_judges_ratio_and_slo() -> None:
    rounds = [_round(4, 8, 0.2), _round(5, 6, 0.3), _round(4, 7, 0.25)]
    off = aggregate_phase([r[0] for r in rounds])
    on = aggregate_phase([r[1] for r in rounds])
    assert off["goodput_tok_s"] == pytest.approx(4 * NEW)
    assert off["goodput_tok_s_spread"] == pytest.approx([4 * NEW, 5 * NEW])
    assert on["goodput_tok_s"] == pytest.approx(7 * NEW)
    assert off["refused"] == 3 and off["refusal_reasons"] == {"queue_full": 3}
    assert on["ttft_ms"]["p99"] == pytest.approx(250.0)
    assert len(on["runs"]) == 3
    verdict = judge_rate(off, on, SLO_MS)
    assert verdict["goodput_ratio"] == pytest.approx(7 / 4)
    assert verdict["goodput_ratio_runs"] == pytest.approx([2.0, 6 / 5, 7 / 4])
    assert verdict["goodput_pass"] is True and verdict["ttft_pass"] is True and verdict["pass"] is True

    late = aggregate_phase([_round(4, 8, 1.2)[1]])
    failed = judge_rate(aggregate_phase([rounds[0][0]]), late, SLO_MS)
    # Late requests are no goodput at all: the ratio drops to 0 and TTFT p99 breaks the SLO.
    assert failed["goodput_ratio"] == 0.0 and failed["ttft_pass"] is False and failed["pass"] is False

    nothing = aggregate_phase([phase_summary("off", [_refused(0, "queue full", 0.001)])])
    unbounded = judge_rate(nothing, aggregate_phase([rounds[0][1]]), SLO_MS)
    assert unbounded["goodput_ratio"] is None and unbounded["goodput_pass"] is True


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _record(tmp_path: Path, off: list[RequestResult], on: list[RequestResult]) -> dict[str, Any]:
    args = _args("--rate", "4", "--smoke", "--json", str(tmp_path / "r.json"))
    assert resolve(args) is None
    workload = {
        "model": PRIMARY, "fallback_model": FALLBACK, "prompt_tokens": 8, "new_tokens": NEW, "rate_rps": 4.0,
        "rate_source": "--rate", "arrival": "poisson", "arrivals_per_phase": len(off), "ttft_slo_ms": SLO_MS,
    }  # fmt: skip
    phases = {
        "off": aggregate_phase([phase_summary("off", off)]),
        "on": aggregate_phase([phase_summary("on", on)]),
    }
    return build_rate_record(
        args, stack={}, machine={"cpu_model": "test cpu"}, workload=workload, capacity=None, phases=phases
    )


def test_the_record_is_voided_by_errors_and_by_the_fallback_serving_with_fallback_off(tmp_path: Path) -> None:
    clean = _record(tmp_path, [_ok(0, 0.1), _refused(1, "queue full", 0.001)], [_ok(0, 0.1), _ok(1, 0.2)])
    assert clean["voided"] is False and clean["invalid_reasons"] == ["--smoke run"]
    assert clean["target"]["goodput_ratio"] == pytest.approx(2.0)
    assert "network hop" in clean["notes"]["refusal_decision_ms"]
    text = format_rate_report(clean)
    assert "goodput on/off: 2.00" in text and "PASS" in text and "queue_full:1" in text

    leaked = _record(
        tmp_path, [_ok(0, 0.1, model=FALLBACK, fallback_reason="primary unavailable")], [_ok(0, 0.1)]
    )
    assert leaked["voided"] is True
    assert any("fallback off" in reason for reason in leaked["invalid_reasons"])
    failed = RequestResult(index=1, send_lag_s=0.0, status="INTERNAL", ttft_s=None, e2e_s=0.1)
    broken = _record(tmp_path, [_ok(0, 0.1)], [_ok(0, 0.1), failed])
    assert broken["voided"] is True and "errors {'INTERNAL': 1}" in broken["invalid_reasons"][0]


def test_the_rate_plot_is_a_png(tmp_path: Path) -> None:
    record = _record(
        tmp_path,
        [_ok(0, 0.1), _refused(1, "queue full", 0.001), _refused(2, "token budget", 0.002)],
        [_ok(0, 0.1), _ok(1, 0.9, model=FALLBACK, fallback_reason="primary saturated")],
    )
    path = tmp_path / "plots" / "rate.png"
    write_rate_plot(record, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_rate_options_take_open_loop_defaults_and_refuse_closed_loop_ones(tmp_path: Path) -> None:
    args = _args("--rate", "auto")
    assert resolve(args) is None
    assert args.rate == "auto"
    assert (args.prompt_tokens, args.new_tokens, args.runs, args.duration, args.gap) == (32, 32, 3, 20.0, 3.0)
    assert args.arrival == "poisson" and args.rate_factor == 2.0 and args.ttft_slo_ms is None
    args = _args("--rate", "12.5", "--smoke", "--arrival", "fixed", "--json", str(tmp_path / "x.json"))
    assert resolve(args) is None
    assert args.rate == 12.5 and args.runs == 1 and args.plot == tmp_path / "x.png"
    for argv in (("--engine-baseline",), ("--concurrency", "1,8"), ("--requests-per-level", "4")):
        problem = resolve(_args("--rate", "3", *argv))
        assert problem is not None and problem.startswith("--rate is an open loop"), argv
    for argv, problem in (
        (("--runs", "2"), "--runs 2: at least 3 rounds (median and spread); --smoke allows 1"),
        (("--arrivals", "0"), "--arrivals 0 must be >= 1"),
        (("--capacity-requests", "0"), "--capacity-requests 0 must be >= 1"),
        (("--ttft-slo-ms", "0"), "--ttft-slo-ms 0.0 must be > 0"),
        (("--duration", "-2"), "--duration -2.0 must be > 0"),
        (("--gap", "-1"), "--gap -1.0 must be >= 0"),
        (("--warmup-requests", "-1"), "--warmup-requests -1 must be >= 0"),
    ):
        assert resolve(_args("--rate", "3", *argv)) == problem, argv
    # What only the closed loop checks does not apply to the open loop.
    assert resolve(_args("--rate", "3", "--ttft-requests", "0")) is None
    for bad in ("0", "-1", "fast"):
        with pytest.raises(SystemExit):
            _args("--rate", bad)
    assert main(["--rate", "3", "--engine-baseline"]) == 2


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
