"""bench/flood.py's verdicts: the targets read the `fair` rounds only, every round's requests together:
the quiet tenant's TTFT p99 against the SLO, its refusals, and the flood's refusals' p99 inside the
gateway. The run itself starts stacks and is the benchmark's."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from bench.flood import CONTESTANTS, TARGET_REFUSAL_P99_MS, _copy, _targets
from strata.settings import DEFAULT_CONFIG, read_config

if TYPE_CHECKING:
    from pathlib import Path


def phase(contestant: str, ttfts: list[float], refused: int, inside: list[float]) -> dict[str, Any]:
    return {
        "contestant": contestant,
        "quiet": {"ttft_s": ttfts, "statuses": ["OK"] * len(ttfts), "refused": ["overloaded"] * refused},
        "flood": {
            "refusal_gateway_s": inside,
            "refusal_client_ms_p99": 5.0,
            "calls": 100,
            "statuses": {"RESOURCE_EXHAUSTED (admission)": len(inside)},
        },
        "gateway_rss_mib": {"before": 80.0, "peak": 160.0, "after": 120.0},
    }


def test_the_targets_pool_the_fair_rounds_and_leave_fifo_out() -> None:
    rounds = [
        phase("fair", [0.5, 0.9], 0, [0.001] * 99 + [0.2]),
        phase("fifo", [], 8, [0.5] * 100),
        phase("fair", [1.2, 1.9], 0, [0.002] * 100),
    ]
    ttft, refused, inside = _targets(rounds, 2000.0)
    assert ttft["met"] and ttft["figure"] == "1879 ms"  # interpolated, as numpy's default
    assert refused["met"] and refused["figure"] == "0 refused"
    assert inside["met"], inside  # the one slow refusal of 200 is past the p99
    late = [*rounds, phase("fair", [2.5], 1, [TARGET_REFUSAL_P99_MS / 1000 * 2] * 10)]
    ttft, refused, inside = _targets(late, 2000.0)
    assert not ttft["met"] and not refused["met"] and not inside["met"]


def test_each_contestant_runs_the_default_stack_with_its_own_fairness(tmp_path: Path) -> None:
    """`fair` keeps the config's credit reserve, `fair, no reserve` sets every route's to 0, `fifo`
    turns fair queuing off; all three carry the two tenants' keys."""
    args = argparse.Namespace(config=DEFAULT_CONFIG)
    configured = read_config(DEFAULT_CONFIG)["gateway"]["routes"]
    for name, (fair, reserve) in CONTESTANTS.items():
        path, model = _copy(args, tmp_path, name)
        gateway = read_config(path)["gateway"]
        assert model == configured[0]["model"] and gateway["fair_queuing"] is fair
        assert sorted(tenant["name"] for tenant in gateway["tenants"]) == ["flood", "quiet"]
        for route, original in zip(gateway["routes"], configured, strict=True):
            wanted = original.get("fair_reserve_share") if reserve is None else reserve
            assert route.get("fair_reserve_share") == wanted
    assert CONTESTANTS["fair, no reserve"] == (True, 0.0)
