"""The step-time model alone: a least-squares fit of fixed + per decode + per prefill token. No I/O."""

from __future__ import annotations

import pytest

from gateway.step_cost import RECENT_SAMPLES, SIZED_SAMPLES, STEP_COST_MIN_SAMPLES, StepCost


def steps(cost: StepCost, fixed: float, per_decode: float, per_token: float, count: int = 24) -> None:
    for i in range(count):
        decodes, prefill = 4 + 3 * (i % 5), 96 * (i % 3)
        cost.add(decodes, prefill, fixed + per_decode * decodes + per_token * prefill)


def test_the_fit_recovers_the_coefficients_of_exact_steps() -> None:
    cost = StepCost()
    steps(cost, 0.020, 0.003, 0.0013)
    assert cost.coefficients == pytest.approx((0.020, 0.003, 0.0013), rel=1e-6)


def test_unfitted_until_enough_steps_and_until_prefill_varies() -> None:
    cost = StepCost()
    for i in range(STEP_COST_MIN_SAMPLES - 1):
        cost.add(4 + i, 64 * (i % 2), 0.05 + 0.001 * i)
    assert cost.coefficients is None  # too few
    decode_only = StepCost()
    for i in range(32):
        decode_only.add(4 + i % 7, 0, 0.02 + 0.003 * (4 + i % 7))
    assert decode_only.coefficients is None  # no step had prefill: its price is unknown


def test_a_negative_coefficient_is_dropped_and_the_rest_refitted() -> None:
    """Steps whose time falls with their batch (noise on a shared core) never price decodes below zero."""
    cost = StepCost()
    for i in range(24):
        decodes, prefill = 4 + 3 * (i % 5), 96 * (i % 3)
        cost.add(decodes, prefill, 0.2 - 0.001 * decodes + 0.001 * prefill)
    fit = cost.coefficients
    assert fit is not None
    fixed, per_decode, per_token = fit
    assert per_decode == 0.0 and fixed > 0 and per_token == pytest.approx(0.001, rel=0.2)


def test_the_fit_follows_the_latest_steps_and_a_new_stream_starts_over() -> None:
    cost = StepCost()
    steps(cost, 0.020, 0.003, 0.0013)
    steps(cost, 0.040, 0.006, 0.0026, count=4 * RECENT_SAMPLES)
    assert cost.coefficients == pytest.approx((0.040, 0.006, 0.0026), rel=1e-6)
    cost.clear()
    assert cost.coefficients is None


def test_steps_with_long_prefills_keep_pricing_long_prompts_however_many_short_ones_follow() -> None:
    """Short prompts carry an overhead that grows with them up to 64 tokens, which a fit on them alone
    reads as a per-token price (half again too slow at 512 tokens); the last long-prefill steps stay in
    the fit and anchor it."""

    def seconds(decodes: int, prefill: int) -> float:
        return 0.02 + 0.003 * decodes + 0.001 * prefill + 0.03 * min(prefill, 64) / 64

    def price(cost: StepCost) -> float:
        fit = cost.coefficients
        assert fit is not None
        return fit[0] + fit[2] * 512 + cost.per_chunk

    true = seconds(0, 512)
    short_only, anchored = StepCost(), StepCost()
    for i in range(SIZED_SAMPLES):
        anchored.add(4 + i % 5, 480, seconds(4 + i % 5, 480))
    for i in range(10 * RECENT_SAMPLES):
        decodes, prefill = 4 + 3 * (i % 5), 32 * (i % 3)
        for cost in (short_only, anchored):
            cost.add(decodes, prefill, seconds(decodes, prefill))
    assert price(short_only) > 1.3 * true
    assert price(anchored) == pytest.approx(true, rel=0.1)


def test_a_chunk_has_a_price_of_its_own_once_two_prefill_sizes_tell_it_apart() -> None:
    """On a CPU any prefill takes a step off the fused decode path: 60 ms whatever the chunk. With steps
    of one prefill size the price stays in the tokens'; with two or more the fit finds it, and a small
    chunk is priced whole where a line in tokens would price it at a third."""

    def seconds(decodes: int, prefill: int) -> float:
        return 0.02 + 0.003 * decodes + 0.001 * prefill + (0.06 if prefill else 0.0)

    one_size, sizes = StepCost(), StepCost()
    for i in range(3 * RECENT_SAMPLES):
        decodes = 2 + i % 5
        one_size.add(decodes, 16 * (i % 2), seconds(decodes, 16 * (i % 2)))
        prefill = (0, 16, 128)[i % 3]
        sizes.add(decodes, prefill, seconds(decodes, prefill))
    assert one_size.per_chunk == 0.0
    fixed, _, per_token = one_size.coefficients or (0.0, 0.0, 0.0)
    assert fixed + per_token * 16 == pytest.approx(0.02 + 0.016 + 0.06, rel=1e-6)  # in the tokens' price
    assert sizes.per_chunk == pytest.approx(0.06, rel=1e-6)
    assert sizes.coefficients == pytest.approx((0.02, 0.003, 0.001), rel=1e-6)
