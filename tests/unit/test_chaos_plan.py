"""The chaos soak's pure parts: the fault schedule and the load plan from a seed, percentiles, and the
RSS series' warm baseline (tests/reliability/chaos_plan.py, chaos_probes.py)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from tests.reliability.chaos_plan import (
    GATEWAY,
    TARGETS,
    Fault,
    FaultKind,
    LoadMix,
    fault_schedule,
    load_plan,
    percentile,
    prompts,
)
from tests.reliability.chaos_probes import RssSeries

MIX = LoadMix(
    rate_rps=10, span_s=60, prompts=24, new_tokens=(4, 40), timeout_s=20, short_deadline_s=(0.2, 1.0)
)


def _schedule(seed: int, count: int = 15, gateway_kills: int = 3) -> list[Fault]:
    return fault_schedule(seed, count, gateway_kills=gateway_kills, pause_s=(1.0, 2.0), stopped_s=(0.5, 1.5))


@pytest.mark.parametrize("seed", range(20))
def test_the_schedule_covers_every_pair_and_never_hits_one_service_twice_in_a_row(seed: int) -> None:
    faults = _schedule(seed)
    assert len(faults) == 15 + 3
    assert [f.index for f in faults] == list(range(18))
    pairs = {(f.target, f.kind) for f in faults if f.target != GATEWAY}
    assert pairs == {(t, k) for t in TARGETS for k in FaultKind}
    gateway = [f for f in faults if f.target == GATEWAY]
    assert len(gateway) == 3 and all(f.kind is FaultKind.KILL for f in gateway)
    assert all(a.target != b.target for a, b in itertools.pairwise(faults))
    assert all(1.0 <= f.pause_s <= 2.0 for f in faults)
    assert all((0.5 <= f.stopped_s <= 1.5) == (f.kind is FaultKind.STOP) for f in faults)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    assert _schedule(7) == _schedule(7)
    assert _schedule(7) != _schedule(8)


def test_the_smallest_schedule_is_each_pair_once() -> None:
    faults = _schedule(3, count=9, gateway_kills=1)
    assert Counter((f.target, f.kind) for f in faults if f.target != GATEWAY) == {
        (t, k): 1 for t in TARGETS for k in FaultKind
    }


def test_a_schedule_too_short_for_every_pair_is_refused() -> None:
    with pytest.raises(ValueError, match="cover"):
        _schedule(0, count=8)


def test_the_load_plan_is_open_loop_poisson_within_its_span_and_bounds() -> None:
    plan = load_plan(5, MIX)
    assert plan == load_plan(5, MIX)
    assert plan != load_plan(6, MIX)
    arrivals = [p.at_s for p in plan]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0 and arrivals[-1] < MIX.span_s
    assert 0.8 * 600 < len(plan) < 1.2 * 600  # rate x span, within Poisson's spread at this seed
    assert [p.index for p in plan] == list(range(len(plan)))
    assert len({p.request_id for p in plan}) == len(plan)
    assert all(0 <= p.prompt < MIX.prompts and 4 <= p.max_new_tokens <= 40 for p in plan)


def test_the_load_mix_has_each_kind_in_its_share() -> None:
    plan = load_plan(5, MIX)
    cancels = [p for p in plan if p.cancel_after]
    shorts = [p for p in plan if p.short_deadline]
    sampled = [p for p in plan if p.sampled]
    for group, share in ((cancels, 0.1), (shorts, 0.1), (sampled, 0.08)):
        assert 0.5 * share * len(plan) < len(group) < 1.5 * share * len(plan)
    assert all(p.stream and 1 <= p.cancel_after <= max(1, p.max_new_tokens // 2) for p in cancels)
    assert all(0.2 <= p.timeout_s <= 1.0 and not p.cancel_after for p in shorts)
    assert all(p.timeout_s == MIX.timeout_s for p in plan if not p.short_deadline)
    assert not any(p.checked for p in sampled) and all(p.checked for p in cancels + shorts)
    streams = sum(p.stream for p in plan if not p.cancel_after)
    assert 0.4 < streams / (len(plan) - len(cancels)) < 0.6


def test_the_plan_stops_at_max_requests() -> None:
    bounded = LoadMix(
        rate_rps=1000,
        span_s=60,
        prompts=4,
        new_tokens=(1, 2),
        timeout_s=1,
        short_deadline_s=(0.1, 0.2),
        max_requests=50,
    )
    assert len(load_plan(0, bounded)) == 50


def test_prompts_are_distinct_and_seeded() -> None:
    texts = prompts(1, 30, (1, 5), ("a", "b"))
    assert len(set(texts)) == 30 and texts == prompts(1, 30, (1, 5), ("a", "b"))
    assert all(1 <= len(t.split(": ", 1)[1].split()) <= 5 for t in texts)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.9) == 5.0
    assert percentile([1.0, 9.0], 1.0) == 9.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_an_rss_series_is_judged_from_its_warm_baseline_to_its_last_sample() -> None:
    series = RssSeries("worker 0", 42, [(5.0, 100), (10.0, 120), (15.0, 130), (70.0, 135), (90.0, 143)])
    assert series.baseline(60.0) == 135
    assert series.growth(60.0) == pytest.approx((143 - 135) / 135)
    assert series.growth(100.0) is None
    assert series.baseline(60.0, since=20.0) == 143  # it began serving at 20 s
    assert series.growth(60.0, since=40.0) is None
    assert RssSeries("gateway", 1).growth(1.0) is None
