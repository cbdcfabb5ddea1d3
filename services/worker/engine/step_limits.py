"""How much one engine step may hold: how many sequences run, and how many prompt tokens join them.

Owns the running limit that load shedding lowers (halved after an out-of-memory step, regained one per
shed_recovery_steps good steps), the prefill budget a step's decodes leave (the token budget less
decode_cost_tokens per decode, never below one block, so a waiting prompt always advances), and the
caps an inter-token SLO puts on both. A sequence may carry such an SLO (its route's itl_slo_ms): then,
with the engine's step-time fit (strata/step_cost.py, over the steps' cadence), a step's prefill is cut
so that the step is forecast to last at most ITL_HEADROOM of the tightest SLO among the sequences
running, and no sequence is admitted once one more decode would push a step with one block of prefill
past it. Prefill then waits, or goes in smaller chunks, rather than stretch the decoding streams'
steps (Sarathi-Serve's stall-free batching, with the budget taken from the SLO instead of fixed). The
worker reports the limits it holds in each StepInfo, so a gateway's TTFT forecast counts the smaller
chunks and the fewer slots. This module must not choose sequences nor touch blocks (scheduler.py
does) nor time steps (the engine fits the line and hands it over).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.worker.engine.config import EngineConfig

ITL_HEADROOM = 0.8
"""Share of the inter-token SLO a step is planned to take: the rest absorbs what the fit cannot see
(a step's jitter on shared cores, the hop to the client, messages merged on the way)."""

CostLine = tuple[float, float, float]
"""(fixed s, s per decode, s per prefill token) of a step: StepCost.coefficients."""


class StepLimits:
    """The running limit and prefill budget of the next step, for the scheduler to obey."""

    def __init__(self, config: EngineConfig, block_size: int) -> None:
        self._config = config
        self._block_size = block_size
        self.shed_limit = config.max_num_seqs
        """The running limit load shedding left: max_num_seqs until a step runs out of memory."""
        self.num_load_sheds = 0
        self._steps_since_shed = 0
        self.cost: CostLine | None = None
        """The engine's step-time fit; None until it has one (no SLO cap applies before)."""

    def shed(self, kept: int) -> None:
        """A step ran out of memory and `kept` sequences still run: run at most that many for now."""
        self.shed_limit = max(1, min(self.shed_limit, kept))
        self.num_load_sheds += 1
        self._steps_since_shed = 0

    def stepped(self) -> None:
        """A step went through: after shed_recovery_steps of them, allow one more sequence."""
        if self.shed_limit >= self._config.max_num_seqs:
            return
        self._steps_since_shed += 1
        if self._steps_since_shed >= self._config.shed_recovery_steps:
            self.shed_limit += 1
            self._steps_since_shed = 0

    def max_running(self, itl_slo_s: float | None) -> int:
        """Sequences that may run at once: the shed limit, and under an inter-token SLO the most
        decodes a step may hold beside one block of prefill and stay within its headroom (at least 1)."""
        line = self._line(itl_slo_s)
        if line is None:
            return self.shed_limit
        target, (fixed, per_decode, per_token) = line
        if per_decode <= 0:
            return self.shed_limit
        room = (target - fixed - per_token * self._block_size) / per_decode
        return max(1, min(self.shed_limit, math.floor(room)))

    def prefill_budget(self, num_decodes: int, itl_slo_s: float | None = None) -> int:
        """Prompt tokens a step with `num_decodes` decodes may compute: the token budget less what the
        decodes cost, and under an inter-token SLO what keeps the step within its headroom; never
        below one block (a waiting prompt always advances)."""
        budget = self._config.max_num_batched_tokens
        floor = min(self._block_size, budget)
        left = budget - int(num_decodes * self._config.decode_cost_tokens + 0.5)
        line = self._line(itl_slo_s)
        if line is not None:
            target, (fixed, per_decode, per_token) = line
            left = min(left, math.floor((target - fixed - per_decode * num_decodes) / per_token))
        return max(floor, left)

    def _line(self, itl_slo_s: float | None) -> tuple[float, CostLine] | None:
        """(the step's planned seconds, the fit) when an SLO applies and the fit prices prefill."""
        if itl_slo_s is None or self.cost is None or self.cost[2] <= 0:
            return None
        return itl_slo_s * ITL_HEADROOM, self.cost
