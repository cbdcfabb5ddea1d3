"""`python -m bench.tenants`'s pure parts: water-filling and Jain's index, a tenant's round reduced
from synthetic results, the fairness between tenants, the rounds and the verdict, the record, its
table and plot, and the command line's option errors. The driver's metadata, the config copy and the
smoke run against a spawned stack are tests/unit/test_bench_tenants_stack.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from bench.fairness import jain_index, normalized_throughputs, water_fill
from bench.plots import write_tenant_plot
from bench.provenance import schema_problems, start_provenance
from bench.tenant_phase import aggregate_contestant, fairness, summarize_round, summarize_tenant
from bench.tenant_report import build_record, format_report, judge
from bench.tenants import DEFAULT_JSON, build_parser, main, resolve
from tests.unit.bench_rate_helpers import CHECKOUT, NEW, PRIMARY, failed, ok, refused

if TYPE_CHECKING:
    from pathlib import Path

    from bench.driver import RequestResult

PROMPT = 8
SLO_MS = 1000.0


def test_water_filling_caps_a_small_demand_and_splits_the_rest() -> None:
    assert water_fill([1.0, 10.0], 8.0) == pytest.approx([1.0, 7.0])
    assert water_fill([10.0, 1.0], 8.0) == pytest.approx([7.0, 1.0])
    # Both ask more than half: an equal split. Both ask less than there is: their demands.
    assert water_fill([10.0, 20.0], 8.0) == pytest.approx([4.0, 4.0])
    assert water_fill([1.0, 2.0], 8.0) == pytest.approx([1.0, 2.0])
    # Satisfied tenants leave in rounds: 1 fits under 3, then 3 under (9 - 1) / 2 = 4; the rest is 5.
    assert water_fill([1.0, 3.0, 10.0], 9.0) == pytest.approx([1.0, 3.0, 5.0])
    assert water_fill([10.0, 10.0], 9.0, weights=[2.0, 1.0]) == pytest.approx([6.0, 3.0])
    assert water_fill([5.0, 5.0], 0.0) == [0.0, 0.0]
    with pytest.raises(ValueError, match="weights"):
        water_fill([1.0, 2.0], 3.0, weights=[1.0])
    with pytest.raises(ValueError, match=">= 0"):
        water_fill([-1.0, 2.0], 3.0)


def test_jain_is_one_for_equal_shares_and_half_when_one_of_two_is_starved() -> None:
    assert jain_index([0.7, 0.7]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0]) == pytest.approx(0.5)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([1.0, 2.0]) == pytest.approx(9.0 / 10.0)
    assert jain_index([]) is None and jain_index([0.0, 0.0]) is None
    with pytest.raises(ValueError, match="finite"):
        jain_index([1.0, float("inf")])
    # Normalized by what each was due: min(demand, fair share); nothing due is no figure.
    assert normalized_throughputs([400.0, 25.0], [1000.0, 50.0], [375.0, 50.0]) == pytest.approx(
        [400.0 / 375.0, 0.5]
    )
    assert normalized_throughputs([0.0], [10.0], [0.0]) == [None]


def _tenant(results: list[RequestResult], wall_s: float = 2.0) -> dict[str, Any]:
    return summarize_tenant(
        results, prompt_tokens=PROMPT, new_tokens=NEW, wall_s=wall_s, slo_ms=SLO_MS, primary=PRIMARY
    )


def test_a_tenant_round_counts_admission_goodput_cost_and_misses() -> None:
    results = [
        ok(0, 0.2),
        ok(1, 1.5),  # completed, but past the SLO: served, yet no goodput
        refused(2, "queue full: 64 requests waiting", 0.010),  # at admission
        refused(3, "request shed under overload", 2.0),  # after 50 ms: admitted, a miss
        failed(4, "DEADLINE_EXCEEDED", 3.0),  # admitted, a miss, and an error
    ]
    tenant = _tenant(results)
    assert (tenant["offered"], tenant["admitted"], tenant["refused"], tenant["completed"]) == (5, 4, 1, 2)
    assert tenant["served_share"] == pytest.approx(2 / 5)
    assert tenant["good_requests"] == 1 and tenant["goodput_tok_s"] == pytest.approx(NEW / 2.0)
    assert tenant["served_cost_tok_s"] == pytest.approx(2 * (PROMPT + NEW) / 2.0)
    assert tenant["demand_tok_s"] == pytest.approx(5 * (PROMPT + NEW) / 2.0)
    # Two of four admitted never got a first token: the p99 lands on a miss.
    ttft = tenant["admitted_ttft"]
    assert ttft["admitted"] == 4 and ttft["no_first_token"] == 2 and ttft["ttft_ms"]["p99"] is None
    assert ttft["ttft_ms"]["p50"] is None  # half the admitted are misses
    assert tenant["refusal_reasons"] == {"queue_full": 1}
    assert tenant["admitted_failures"] == {"RESOURCE_EXHAUSTED:shed": 1, "DEADLINE_EXCEEDED": 1}
    assert tenant["errors"] == {"DEADLINE_EXCEEDED": 1} and tenant["fallback_served"] == 0
    served_elsewhere = _tenant([ok(0, 0.1, model="fallback"), ok(1, 0.1, tokens=NEW - 1)])
    assert served_elsewhere["fallback_served"] == 1 and served_elsewhere["token_mismatches"] == 1


def _round(
    noisy_done: int, quiet_done: int, *, quiet_ttft_s: float = 0.1, contestant: str = "on", index: int = 0
) -> dict[str, Any]:
    """10 noisy and 2 quiet arrivals over 1 s (a request costs 12 tokens); the first `*_done` of each
    complete, the noisy ones 0.5 s to their first token, the rest are refused at once."""

    def results(done: int, total: int, ttft_s: float) -> list[RequestResult]:
        return [ok(i, ttft_s) if i < done else refused(i, "queue full", 0.005) for i in range(total)]

    tenants = {
        "noisy": _tenant(results(noisy_done, 10, 0.5), wall_s=1.0),
        "quiet": _tenant(results(quiet_done, 2, quiet_ttft_s), wall_s=1.0),
    }
    return summarize_round(tenants, contestant=contestant, round_index=index, wall_s=1.0)


def test_fairness_between_tenants_is_jain_over_what_each_was_due() -> None:
    # The quiet tenant served all it asked (24 tok/s, under half of the 60 served), the noisy one
    # the rest: each got all it was due.
    fair = _round(3, 2)["fairness"]
    assert fair["capacity_tok_s"] == pytest.approx(60.0)
    assert fair["fair_share_tok_s"] == pytest.approx({"noisy": 36.0, "quiet": 24.0})
    assert fair["normalized"] == pytest.approx({"noisy": 1.0, "quiet": 1.0})
    assert fair["jain_index"] == pytest.approx(1.0)
    # The quiet tenant starved while the noisy one is served: one of two, 0.5.
    starved = _round(5, 0)["fairness"]
    assert starved["fair_share_tok_s"] == pytest.approx({"noisy": 36.0, "quiet": 24.0})
    assert starved["jain_index"] == pytest.approx(0.5)
    # Half the quiet demand served: y = 36/24 and 12/24.
    assert _round(3, 1)["fairness"]["jain_index"] == pytest.approx(2.0**2 / (2 * (1.5**2 + 0.5**2)))
    # A quiet demand above half of what was served is capped at half: it may be over-served.
    capped = fairness({"noisy": {"served_cost_tok_s": 36.0, "demand_tok_s": 120.0},
                       "quiet": {"served_cost_tok_s": 48.0, "demand_tok_s": 48.0}})  # fmt: skip
    assert capped["fair_share_tok_s"] == pytest.approx({"noisy": 42.0, "quiet": 42.0})
    assert capped["normalized"] == pytest.approx({"noisy": 36.0 / 42.0, "quiet": 48.0 / 42.0})
    assert _round(0, 0)["fairness"]["jain_index"] is None  # nothing served: nothing to judge


def _contestants() -> dict[str, dict[str, Any]]:
    """On: fair in every round. Off: one round starves the quiet tenant, one misses its SLO."""
    on = [_round(3, 2), _round(4, 2, index=1), _round(3, 2, quiet_ttft_s=0.3, index=2)]
    off = [_round(6, 0, contestant="off"), _round(3, 2, contestant="off", index=1),
           _round(3, 2, quiet_ttft_s=1.5, contestant="off", index=2)]  # fmt: skip
    return {"on": aggregate_contestant(on), "off": aggregate_contestant(off)}


def test_rounds_reduce_to_medians_and_the_verdict_takes_each_figures_worst_round() -> None:
    contestants = _contestants()
    on, off = contestants["on"], contestants["off"]
    assert on["quiet_admitted_ttft_p99_ms_runs"] == pytest.approx([100.0, 100.0, 300.0])
    assert on["quiet_admitted_ttft_p99_ms"] == pytest.approx(100.0)
    assert on["quiet_admitted_ttft_p99_ms_spread"] == pytest.approx([100.0, 300.0])
    assert on["quiet_served_share_runs"] == [1.0, 1.0, 1.0]
    assert on["tenants"]["noisy"]["goodput_tok_s_runs"] == pytest.approx([12.0, 16.0, 12.0])
    assert on["tenants"]["noisy"]["completed"] == 10 and on["tenants"]["quiet"]["refused"] == 0
    # The starved round admitted no quiet request: its p99 is a miss, infinite in the median.
    assert off["quiet_admitted_ttft_p99_ms_runs"][0] is None
    assert off["quiet_admitted_ttft_p99_ms"] == pytest.approx(1500.0)
    assert off["quiet_admitted_ttft_p99_ms_spread"] == [pytest.approx(100.0), None]
    assert off["jain_index_runs"][0] == pytest.approx(0.5)
    target = judge(contestants, SLO_MS)
    assert target["judged"] == "on" and target["pass"] is True
    assert target["on"]["quiet_ttft_p99"] == {
        "value_ms": pytest.approx(300.0),
        "limit_ms": SLO_MS,
        "pass": True,
    }
    # FIFO beside it: its worst rounds fail all three, though its median share and Jain pass.
    assert off["quiet_served_share"] == 1.0 and off["jain_index"] == pytest.approx(1.0)
    assert target["off"]["quiet_ttft_p99"]["value_ms"] is None
    assert target["off"]["quiet_served_share"]["value"] == 0.0
    assert target["off"]["jain_index"]["value"] == pytest.approx(0.5)
    assert not any(
        target["off"][key]["pass"] for key in ("quiet_ttft_p99", "quiet_served_share", "jain_index")
    )
    contestants["on"] = aggregate_contestant([_round(3, 2), _round(3, 1), _round(3, 2)])
    shortfall = judge(contestants, SLO_MS)["on"]
    assert shortfall["quiet_served_share"] == {"value": 0.5, "min": 0.99, "pass": False}
    assert shortfall["jain_index"]["pass"] is False and shortfall["pass"] is False


def _record(contestants: dict[str, dict[str, Any]], *argv: str) -> dict[str, Any]:
    args = build_parser().parse_args(["--smoke", *argv])
    assert resolve(args) is None
    workload = {"model": PRIMARY, "new_tokens": NEW, "ttft_slo_ms": SLO_MS}
    rates = {
        name: {"prompt_tokens": PROMPT, "capacity_rps": 2.0, "factor": factor, "rate_rps": 2.0 * factor,
               "arrivals_per_phase": count, "schedule_s": 1.0}
        for name, factor, count in (("noisy", 5.0, 10), ("quiet", 0.3, 2))
    }  # fmt: skip
    return build_record(
        args, checkout=CHECKOUT, provenance=start_provenance(), workload=workload,
        capacity={"shapes": {}}, stack={}, rates=rates, phases=[], contestants=contestants,
    )  # fmt: skip


def test_the_record_table_and_plot_hold_both_contestants_and_errors_void_it(tmp_path: Path) -> None:
    record = _record(_contestants())
    assert record["pass"] is True and record["voided"] is False
    assert record["invalid_reasons"] == ["--smoke run"] and record["checkout"] == CHECKOUT
    assert {"provenance", "config", "capacity", "rates", "phases", "contestants", "target", "notes"} <= set(
        record
    )
    assert record["config"]["noisy_factor"] == 5.0 and schema_problems(record) == []

    table = format_report(record)
    assert "noisy: 8-token prompts at 10.00 req/s = 5 x capacity 2.00 req/s" in table
    assert "verdict, fair queuing on (worst round)" in table and "beside it, fair queuing off" in table
    assert table.count("round 3") == 2 and "inf" in table
    path = tmp_path / "tenants.png"
    write_tenant_plot(record, path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    broken = _contestants()
    broken["off"]["tenants"]["noisy"]["errors"] = {"UNAUTHENTICATED": 10}
    broken["on"]["tenants"]["quiet"]["fallback_served"] = 1
    voided = _record(broken)
    assert voided["voided"] is True and len(voided["invalid_reasons"]) == 3
    reasons = " | ".join(voided["invalid_reasons"])
    assert "fair queuing off, tenant noisy: errors" in reasons
    assert "fair queuing on, tenant quiet: no_fallback requests served by" in reasons


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--runs", "2"], "--runs 2: at least 3 rounds"),
        (["--smoke", "--runs", "0"], "--runs 0"),
        (["--noisy-factor", "0"], "--noisy-factor 0.0 must be > 0"),
        (["--quiet-factor", "nan"], "--quiet-factor nan must be > 0 and finite"),
        (["--duration", "-1"], "--duration -1.0 must be > 0"),
        (["--gap", "-0.5"], "--gap -0.5 must be >= 0"),
        (["--noisy-prompt-tokens", "0"], "--noisy-prompt-tokens 0 must be >= 1"),
        (["--capacity-concurrency", "0"], "--capacity-concurrency 0 must be >= 1"),
        (["--warmup-requests", "-1"], "--warmup-requests -1 must be >= 0"),
    ],
)
def test_bad_options_are_errors_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_options_default_to_the_benchmark_and_smoke_shrinks_it() -> None:
    args = build_parser().parse_args([])
    assert resolve(args) is None
    assert (args.runs, args.duration, args.new_tokens) == (3, 20.0, 32)
    assert (args.noisy_prompt_tokens, args.quiet_prompt_tokens) == (512, 32)
    assert (args.noisy_factor, args.quiet_factor) == (5.0, 0.3)
    assert args.json == DEFAULT_JSON and args.plot == DEFAULT_JSON.with_suffix(".png")
    smoke = build_parser().parse_args(["--smoke"])
    assert resolve(smoke) is None
    assert smoke.runs == 1 and smoke.json is None and smoke.plot is None
