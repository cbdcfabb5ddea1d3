"""`python -m bench.tenants`'s fairness arithmetic: max-min fair shares by water-filling, and Jain's
index over normalized throughputs."""

from __future__ import annotations

import pytest

from bench.fairness import jain_index, normalized_throughputs, water_fill


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
