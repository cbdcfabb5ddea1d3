"""bench/step_cost.py's fit: least squares recovers a step's fixed, per-decode and per-token costs."""

from __future__ import annotations

import pytest

from bench.step_cost import fit


def test_the_fit_recovers_the_costs_and_their_ratio() -> None:
    samples = [(d, p, 20.0 + 2.5 * d + 1.0 * p) for d in (1, 16, 32, 64) for p in (0, 64, 256)]
    fitted = fit(samples)
    assert fitted["fixed_ms"] == pytest.approx(20.0)
    assert fitted["ms_per_decode"] == pytest.approx(2.5)
    assert fitted["ms_per_prefill_token"] == pytest.approx(1.0)
    assert fitted["decode_cost_tokens"] == pytest.approx(2.5)


def test_shapes_that_cannot_separate_the_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="vary both"):
        fit([(16, 0, 50.0), (16, 0, 51.0), (16, 0, 49.0)])
