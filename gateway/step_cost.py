"""A worker stream's step-time model: seconds = fixed + per_decode x decodes + per_token x prefill tokens +
per_chunk when the step computes any prefill.

The forecast of a first token needs what the steps *carrying its prefill* cost, not the average step: on
a CPU a step with a 384-token chunk takes several times a decode-only step of the same batch, and an
average over mostly short steps promises first tokens far too early. Any prefill also takes a step off
the fused decode path, a price of its own whatever the chunk's size (a 16-token chunk beside a few
decodes takes several times as long as the decodes alone), so a line in tokens alone prices small chunks
(those of a worker keeping an inter-token SLO) far short. StepCost fits the four coefficients by least
squares over the worker's recent steps (their cadence, decodes and prefill tokens; bench/step_cost.py
fits the first three offline). The samples are kept by prefill size: the last RECENT_SAMPLES steps with
little or no prefill, and the last SIZED_SAMPLES of each larger size. So the price of a long prompt
stays anchored on steps that computed long prompts, however many short steps followed: fitted on short
prompts alone, a per-request overhead reads as a per-token price, a long prompt is then forecast far too
slow, refused, and never measured again. A coefficient the samples make negative is dropped (fixed at 0)
and the rest refitted, since no step gets cheaper with more work; a prefill token that comes out free
leaves the model unfitted. Until the samples vary enough to tell the first three apart, the forecast
keeps the average step (`coefficients` is None); with a single prefill size the chunk's price is left in
its tokens' (`per_chunk` is 0). This module does no I/O and must not forecast (forecast.py) nor read
worker messages (forecast.py's LinkLoad feeds it).
"""

from __future__ import annotations

from collections import deque

import numpy as np

RECENT_SAMPLES = 48
"""Steps with less than SIZES[0] prefill tokens the fit keeps: a few seconds of a busy worker."""
SIZES = (64, 256)
"""Prefill sizes from which steps are kept apart, SIZED_SAMPLES of each (64-255 and 256 up)."""
SIZED_SAMPLES = 12
STEP_COST_MIN_SAMPLES = 8

Sample = tuple[float, float, float]
"""(decodes, prefill tokens, seconds) of one step."""


class StepCost:
    """The least-squares step-time model of one worker stream's recent steps."""

    def __init__(self) -> None:
        self._samples: list[deque[Sample]] = [deque(maxlen=RECENT_SAMPLES)]
        self._samples += [deque(maxlen=SIZED_SAMPLES) for _ in SIZES]
        self._fit: tuple[float, float, float, float] | None = None
        self._stale = False

    def clear(self) -> None:
        """A new stream, perhaps a new worker: its steps are not the old one's."""
        for samples in self._samples:
            samples.clear()
        self._fit = None
        self._stale = False

    def add(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        size = sum(prefill_tokens >= bound for bound in SIZES)
        self._samples[size].append((float(decodes), float(prefill_tokens), seconds))
        self._stale = True

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed s, s per decode, s per prefill token); None until the samples tell them apart."""
        fit = self._fitted()
        return None if fit is None else fit[:3]

    @property
    def per_chunk(self) -> float:
        """Seconds a step pays for computing any prefill at all, beyond its tokens; 0 until steps of
        two prefill sizes or more tell it apart."""
        fit = self._fitted()
        return 0.0 if fit is None else fit[3]

    def _fitted(self) -> tuple[float, float, float, float] | None:
        if self._stale:
            self._fit = _fit([sample for samples in self._samples for sample in samples])
            self._stale = False
        return self._fit


def _fit(samples: list[Sample]) -> tuple[float, float, float, float] | None:
    if len(samples) < STEP_COST_MIN_SAMPLES:
        return None
    data = np.asarray(samples)
    chunk = (data[:, 1] > 0).astype(float)
    design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], chunk])
    kept = [0, 1, 2, 3]
    if np.linalg.matrix_rank(design) < 4:
        kept.remove(3)  # one prefill size only: a chunk's own price cannot be told from its tokens'
        if np.linalg.matrix_rank(design[:, :3]) < 3:
            return None  # e.g. no prefill in any step yet: its cost cannot be told from the rest
    while True:
        solution = np.linalg.lstsq(design[:, kept], data[:, 2], rcond=None)[0]
        fitted = dict(zip(kept, (float(value) for value in solution), strict=True))
        if fitted[2] <= 0:
            return None  # prefill looks free: the samples cannot price it, and guessing low breaks promises
        negative = [column for column, value in fitted.items() if value < 0]
        if not negative:
            return fitted.get(0, 0.0), fitted.get(1, 0.0), fitted[2], fitted.get(3, 0.0)
        kept.remove(negative[0])
