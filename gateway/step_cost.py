"""A worker stream's step-time model: seconds = fixed + per_decode x decodes + per_token x prefill tokens.

The forecast of a first token needs what the steps *carrying its prefill* cost, not the average step:
on a CPU a step with a 384-token chunk takes several times a decode-only step of the same batch, and an
average over mostly short steps promises first tokens far too early. StepCost fits the three
coefficients by least squares over the last STEP_COST_SAMPLES steps a worker reported (their cadence,
decodes and prefill tokens; bench/step_cost.py fits the same model offline). A coefficient the samples
make negative is dropped (fixed at 0) and the rest refitted, since no step gets cheaper with more work;
a prefill token that comes out free leaves the model unfitted. Until the samples vary enough to tell
the three apart, the forecast keeps the average step (`coefficients` is None). This module does no I/O
and must not forecast (forecast.py) nor read worker messages (forecast.py's LinkLoad feeds it).
"""

from __future__ import annotations

from collections import deque

import numpy as np

STEP_COST_SAMPLES = 64
"""Steps the fit covers: a few seconds of a busy worker, so it follows a change of load."""
STEP_COST_MIN_SAMPLES = 8


class StepCost:
    """The least-squares step-time model of one worker stream's recent steps."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=STEP_COST_SAMPLES)
        """(decodes, prefill tokens, seconds) of each recent step."""
        self._fit: tuple[float, float, float] | None = None
        self._stale = False

    def clear(self) -> None:
        """A new stream, perhaps a new worker: its steps are not the old one's."""
        self._samples.clear()
        self._fit = None
        self._stale = False

    def add(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        self._samples.append((float(decodes), float(prefill_tokens), seconds))
        self._stale = True

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed s, s per decode, s per prefill token); None until the samples tell them apart."""
        if self._stale:
            self._fit = _fit(self._samples)
            self._stale = False
        return self._fit


def _fit(samples: deque[tuple[float, float, float]]) -> tuple[float, float, float] | None:
    if len(samples) < STEP_COST_MIN_SAMPLES:
        return None
    data = np.asarray(samples)
    design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    if np.linalg.matrix_rank(design) < 3:
        return None  # e.g. no prefill in any step yet: its cost cannot be told from the rest
    kept = [0, 1, 2]
    while True:
        solution = np.linalg.lstsq(design[:, kept], data[:, 2], rcond=None)[0]
        fitted = dict(zip(kept, (float(value) for value in solution), strict=True))
        if fitted[2] <= 0:
            return None  # prefill looks free: the samples cannot price it, and guessing low breaks promises
        negative = [column for column, value in fitted.items() if value < 0]
        if not negative:
            return fitted.get(0, 0.0), fitted.get(1, 0.0), fitted[2]
        kept.remove(negative[0])
