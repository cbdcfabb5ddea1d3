"""A step's cost line: seconds as a + b * tokens, fitted over the recent steps of one model.

The speculation rule (speculation.py) prices a drafted token from two of these: the target's steps,
which score drafts, and a draft model's passes, which find them (draft_model.py feeds its own). This
module only fits and reads the line; it must not decide what to draft nor time anything itself: its
owner observes each step it ran.
"""

from __future__ import annotations

from collections import deque

# Steps the cost model fits over: recent enough to follow the batch's regime (a few rows against
# dozens), long enough to average out a noisy machine.
COST_WINDOW = 64


class StepCostModel:
    """A step's seconds as a + b * tokens, least squares over the last COST_WINDOW steps."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)
        self.fixed = 0.0
        """a: seconds a step costs whatever its size (reading the weights, Python, launching)."""
        self.per_token = 0.0
        """b: seconds each token adds."""
        self.fitted = False

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One finished step: its computed tokens and its forward's seconds."""
        self._steps.append((num_tokens, seconds))
        n = len(self._steps)
        mean_t = sum(t for t, _ in self._steps) / n
        mean_s = sum(s for _, s in self._steps) / n
        spread = sum((t - mean_t) ** 2 for t, _ in self._steps)
        if spread == 0:
            return  # every step the same size: the last fit stands
        slope = sum((t - mean_t) * (s - mean_s) for t, s in self._steps) / spread
        self.per_token = max(0.0, slope)
        self.fixed = max(0.0, mean_s - self.per_token * mean_t)
        self.fitted = True

    def seconds(self, num_tokens: int) -> float:
        """A step of num_tokens tokens, as fitted."""
        return self.fixed + self.per_token * num_tokens

    def draft_cost(self, num_decodes: int, drafting: StepCostModel | None = None) -> float:
        """c: a drafted token's cost relative to the average token of a step of num_decodes decodes;
        drafting: a draft model's passes, each drafting one token for every decode (0 until a fit
        exists: the first steps draft, and measure what it costs)."""
        if not self.fitted or num_decodes < 1:
            return 0.0
        step = self.seconds(num_decodes)
        finding = drafting.seconds(num_decodes) if drafting is not None and drafting.fitted else 0.0
        return (self.per_token * num_decodes + finding) / step if step > 0 else 0.0
