"""How much one engine step may hold: how many sequences run, and how many prompt tokens join them.

Owns the running limit that load shedding lowers (halved after an out-of-memory step, regained one per
shed_recovery_steps good steps), the prefill budget a step's decodes leave (the token budget less
decode_cost_tokens per decode, never below one block, so a waiting prompt always advances), and the caps
an inter-token SLO puts on both. A sequence may carry such an SLO (its route's itl_slo_ms); the tightest
among the running ones sets a step's plan, ITL_HEADROOM of it. Both caps are steered by what the steps
measure, start to next start (the engine loop's work between steps included): the moving average of
decode-only steps, plus the average of what a prefill chunk adds to a step, is what a stream waits for
its next token when prefill joins. Past the plan, the prefill cap drops to the chunk that ran, in the
proportion of plan to pace and at least by half (never below a block); at a block, or when decode-only
steps alone run past the plan, the running limit drops to the decodes the step ran in that proportion
(at most by half), and a few steps pass before the next cut shows. A cut that did not lower the pace is
not repeated: a block's prefill alone takes the plan then, and fewer decodes would only serve fewer. A
run of steps well within the plan raises the prefill cap by a block and the running limit by one,
doubling it instead until the first cut (TCP's congestion window: slow start, additive increase, fast
decrease). So prefill goes in smaller chunks, and the batch stops growing, rather than stretch the
decoding streams' steps (Sarathi-Serve's stall-free batching, its budget found from the SLO).

Measured rather than forecast, since no step-time line fits a CPU: a step with any prefill leaves the
fused decode path for the layer-by-layer one, so a chunk of one block beside a few decodes takes several
times as long as the decodes alone, while each further token adds little; a line over steps the caps
keep alike cannot tell a decode's price from the rest either. The worker reports the limits it holds in
each StepInfo, so a gateway's TTFT forecast counts the smaller chunks and the fewer slots. This module
must not choose sequences nor touch blocks (scheduler.py does) nor time steps (the engine measures them
and hands them over).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.worker.engine.config import EngineConfig

ITL_HEADROOM = 0.9
"""Share of the inter-token SLO a step is planned to take: the rest absorbs what the steps' average
does not show (one step's jitter on shared cores, the hop to the client, messages merged on the way)."""
PACE_EWMA_WEIGHT = 0.25
"""Weight of each step in the moving averages the caps are steered by."""
PACE_GROW_BELOW = 0.85
"""The caps grow only while every average is under this share of the plan: a margin against flapping."""
PACE_GROW_STEPS = 4
"""Steps in a row within that margin for each growth (a block of prefill, one sequence), and steps
after a cut before the next (a cut shows in the averages only after a few steps)."""
PACE_HELPED = 0.95
"""A cut of the running limit helped when the pace after it is under this share of the pace before."""


class StepLimits:
    """The running limit and prefill budget of the next step, for the scheduler to obey."""

    def __init__(self, config: EngineConfig, block_size: int) -> None:
        self._config = config
        self._block_size = block_size
        self.shed_limit = config.max_num_seqs
        """The running limit load shedding left: max_num_seqs until a step runs out of memory."""
        self.num_load_sheds = 0
        self._steps_since_shed = 0
        self.paced_limit = 1
        """The running limit the inter-token SLO's pacing left; it binds only while a sequence has one.
        It starts at one and doubles with each run of calm steps until the first cut (TCP's slow
        start): starting from max_num_seqs, a burst admitted at once ran slow before any cut could
        show, its first tokens came late, and admission learnt a margin that refused for long after."""
        self._slow_start = True
        self.paced_prefill = config.max_num_batched_tokens
        """The prompt tokens a step may take under the pacing; binds only while a sequence has an SLO."""
        self._decode_pace: float | None = None
        """Moving average of the decode-only steps' cadence."""
        self._prefill_extra: float | None = None
        """Moving average of what a step's prefill chunk adds to it (its cadence less the decode pace)."""
        self._calm_steps = 0
        self._cooling = 0
        """Steps left before another cut: a cut shows in the averages only after a few steps."""
        self._last_slo_s: float | None = None
        """The tightest SLO of the last step that decoded sequences carrying one."""
        self._cut_pace: float | None = None
        """The pace when the running limit was last cut; a cut that did not lower it is not repeated."""

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

    def paced(self, seconds: float, decodes: int, prefill_tokens: int, itl_slo_s: float | None) -> None:
        """A step that decoded `decodes` sequences and computed `prefill_tokens` of prompts (the
        tightest SLO among its sequences `itl_slo_s`) lasted `seconds` to the next step's start."""
        if itl_slo_s is None or decodes == 0:
            return
        self._last_slo_s = itl_slo_s
        if prefill_tokens:
            self._prefill_extra = _average(self._prefill_extra, seconds - (self._decode_pace or 0.0))
        else:
            self._decode_pace = _average(self._decode_pace, seconds)
        plan = itl_slo_s * ITL_HEADROOM
        decode = self._decode_pace or 0.0
        pace = decode + (self._prefill_extra or 0.0)
        if self._cooling:
            self._cooling -= 1
        elif not prefill_tokens and decode > plan:
            self._fewer(decodes, decode, plan)  # the decodes alone run past the plan
        elif prefill_tokens and pace > plan:
            if self.paced_prefill > self._block_size:
                # In the proportion of plan to pace, from the chunk that ran; the next step with a
                # chunk measures afresh (the average was of bigger ones), so no cooling is needed.
                chunk = min(self.paced_prefill, prefill_tokens)
                self.paced_prefill = max(self._block_size, min(chunk // 2, math.floor(chunk * plan / pace)))
                self._prefill_extra = None
            else:
                self._fewer(decodes, pace, plan)  # the chunk is one block already
        elif pace < PACE_GROW_BELOW * plan or decode < PACE_GROW_BELOW * plan:
            # Decodes come first (as in Sarathi-Serve): the running limit grows while decode-only steps
            # leave room, and prefill takes what is left; its cap grows only while whole steps do.
            self._calm_steps += 1
            if self._calm_steps >= PACE_GROW_STEPS:
                self._calm_steps = 0
                self._cut_pace = None
                if pace < PACE_GROW_BELOW * plan:
                    self.paced_prefill = min(
                        self._config.max_num_batched_tokens, self.paced_prefill + self._block_size
                    )
                if decodes >= self.paced_limit:  # only a limit that holds the batch back grows
                    grown = 2 * self.paced_limit if self._slow_start else self.paced_limit + 1
                    self.paced_limit = min(self._config.max_num_seqs, grown)
            return
        self._calm_steps = 0

    def _fewer(self, decodes: int, pace: float, plan: float) -> None:
        """Cut the running limit to the `decodes` a step ran in the proportion of plan to pace (at most
        by half), unless the last cut did not lower the pace: then the decodes are not what makes the
        steps slow (one block's prefill alone takes the plan), and fewer would only serve fewer."""
        if self._cut_pace is not None and pace >= PACE_HELPED * self._cut_pace:
            return
        self._cooling = PACE_GROW_STEPS
        self._slow_start = False
        self._cut_pace = pace
        share = max(0.5, plan / pace)
        self.paced_limit = max(1, min(self.paced_limit, math.floor(decodes * share)))

    def reported_slo(self, itl_slo_s: float | None) -> float | None:
        """The SLO the limits a worker reports answer for: `itl_slo_s`, else the last one a step kept.
        Between two requests of an SLO route the worker holds no sequence with one, and reporting the
        unpaced limit then let a gateway send a burst into slots the next step would not run: its first
        tokens came late, and admission learnt a margin that refused for long after."""
        return itl_slo_s if itl_slo_s is not None else self._last_slo_s

    def max_running(self, itl_slo_s: float | None) -> int:
        """Sequences that may run at once: the shed limit, and under an inter-token SLO the limit its
        pacing left."""
        if itl_slo_s is None:
            return self.shed_limit
        return min(self.shed_limit, self.paced_limit)

    def prefill_budget(self, num_decodes: int, itl_slo_s: float | None = None) -> int:
        """Prompt tokens a step with `num_decodes` decodes may compute: the token budget less what the
        decodes cost, under an inter-token SLO at most its pacing's cap; never below one block (a
        waiting prompt always advances)."""
        budget = self._config.max_num_batched_tokens
        left = budget - int(num_decodes * self._config.decode_cost_tokens + 0.5)
        if itl_slo_s is not None:
            left = min(left, self.paced_prefill)
        return max(min(self._block_size, budget), left)


def _average(pace: float | None, seconds: float) -> float:
    return seconds if pace is None else pace + PACE_EWMA_WEIGHT * (seconds - pace)
