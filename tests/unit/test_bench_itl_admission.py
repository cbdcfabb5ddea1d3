"""bench/itl_admission.py's verdicts: which request meets both promises (TTFT within its SLO, mean
time per output token within the ITL SLO), and the targets' ratio per round and its median. The run
itself starts a stack and is the benchmark's."""

from __future__ import annotations

from typing import Any

from bench.driver import RequestResult
from bench.itl_admission import both_met, target


def result(ttft_s: float | None, gaps: list[float], status: str = "OK") -> RequestResult:
    return RequestResult(0, status, ttft_s, 1.0, itl_s=gaps, token_ids=[1] * (len(gaps) + 1))


def test_a_request_meets_both_when_its_first_token_and_its_mean_gap_are_in_time() -> None:
    assert both_met(result(1.5, [0.1, 0.2, 0.1]), 2000.0, 150.0)  # one slow gap, a mean of 133 ms
    assert not both_met(result(1.5, [0.2, 0.2, 0.1]), 2000.0, 150.0)  # a mean of 167 ms
    assert not both_met(result(2.5, [0.1]), 2000.0, 150.0)  # its first token late
    assert not both_met(result(None, [], "RESOURCE_EXHAUSTED"), 2000.0, 150.0)
    assert not both_met(result(1.0, [0.1], "CANCELLED"), 2000.0, 150.0)


def phase_round(goodput: float, both: float, itl_p99: float, ttft_p99: float | None) -> dict[str, Any]:
    return {
        "goodput_tok_s": goodput,
        "goodput_both_tok_s": both,
        "itl_ms": {"p99": itl_p99},
        "routes": {"primary": {"ttft_ms": {"p99": ttft_p99}}},
    }


def test_the_targets_compare_each_round_with_its_neighbour_and_take_the_median() -> None:
    runs = {
        "ttft": [phase_round(200.0, 0.0, 500.0, 1500.0) for _ in range(5)],
        "itl": [
            phase_round(g, g, 160.0, t)
            for g, t in ((190, 2100), (170, 2300), (185, None), (150, 1900), (200, 1800))
        ],
    }
    verdict = target(runs, 2000.0, 150.0)
    assert verdict["goodput_over_ttft_only_rounds"] == [0.95, 0.85, 0.925, 0.75, 1.0]
    assert verdict["goodput_over_ttft_only"] == 0.925 and verdict["goodput_met"]
    assert verdict["itl_p99_over_slo"] == 160.0 / 150.0 and verdict["itl_met"]
    assert (
        verdict["ttft_p99_over_slo"] == 2100.0 / 2000.0 and verdict["ttft_met"]
    )  # a round with no first token counts as a miss
    assert verdict["ttft_phase_itl_p99_over_slo"] == 500.0 / 150.0
