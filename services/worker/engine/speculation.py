"""Speculative decoding's decisions: which decoding sequences draft, how many tokens, and what.

A decode reads every weight to produce one token; a step that scores a sequence's last token and k
drafted ones reads them once for k + 1 positions. The model's own choice at each position decides:
drafts are kept while they equal what it picks, and the position after the last kept one gives one
more token (accepted_tokens). Its pick is the sampler's seeded draw, a function of the position's
logits, seed and output position alone, so the output is the very tokens the sequence would get
without speculation, greedy or sampled: the target distribution is kept exactly, token for token.

The draft length is a rule, not a switch (docs/speculative-decoding.md): a step's seconds are fitted
as a + b * tokens over the recent steps (StepCostModel), so at B decoding sequences a token costs
(a + b * B) / B on average and each drafted token costs b more. The j-th draft of a sequence is taken
while its chance of being kept, alpha ** j (alpha: the sequence's measured per-draft acceptance,
started from an even prior), is at least c = b * B / (a + b * B): what it buys pays what it costs. At
one stream c is small (the weights' read dominates a); at 64 busy streams it is near 1 and nobody
drafts. This module must not schedule, take blocks nor sample: it proposes (ngram.py finds the
tokens), the scheduler fits what it can, the runner scores, step_results.py keeps the accepted ones.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from services.worker.engine.ngram import ngram_proposal

if TYPE_CHECKING:
    from collections.abc import Iterable
    from collections.abc import Sequence as SequenceOf

    from services.worker.engine.config import SpeculativeConfig
    from services.worker.engine.draft_model import DraftModel
    from services.worker.engine.sequence import Sequence

# Steps the cost model fits over: recent enough to follow the batch's regime (a few rows against
# dozens), long enough to average out a noisy machine.
COST_WINDOW = 64
# The acceptance a sequence starts from, as accepted drafts out of trials: one of two.
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0


def accepted_tokens(drafts: SequenceOf[int], samples: SequenceOf[int]) -> list[int]:
    """The tokens a speculative decode yields: samples[i] is the model's pick after the last token
    and drafts[:i]; drafts are kept while they equal the pick, then the first differing pick (or the
    pick after every draft) is one more."""
    if len(samples) != len(drafts) + 1:
        raise ValueError(f"{len(samples)} sampled positions for {len(drafts)} drafts: need one more")
    for i, draft in enumerate(drafts):
        if samples[i] != draft:
            return list(samples[: i + 1])
    return list(samples)


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

    def draft_cost(self, num_decodes: int) -> float:
        """c: a drafted token's cost relative to the average token of a step of num_decodes decodes
        (0 until a fit exists: the first steps draft, and measure what it costs)."""
        if not self.fitted or num_decodes < 1:
            return 0.0
        step = self.fixed + self.per_token * num_decodes
        return self.per_token * num_decodes / step if step > 0 else 0.0


def acceptance(seq: Sequence) -> float:
    """seq's per-draft acceptance so far, started from the prior."""
    return (seq.num_accepted_drafts + PRIOR_ACCEPTED) / (seq.num_draft_trials + PRIOR_TRIALS)


def draft_length(alpha: float, cost: float, most: int) -> int:
    """The most drafts j <= most whose chance of being kept, alpha ** j, is at least `cost`."""
    length, chance = 0, 1.0
    while length < most:
        chance *= alpha
        if chance < cost:
            break
        length += 1
    return length


class Speculator:
    """Proposes drafts for one engine's decoding sequences each step. Used from the engine thread."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None
    ) -> None:
        """draft: the draft model, for method "draft"."""
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        self.costs = StepCostModel()

    def release(self, request_id: str) -> None:
        """The request ended: whatever the draft model holds for it goes back now."""
        if self.draft is not None:
            self.draft.release(request_id)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Feed the cost model one finished step: its computed tokens and its seconds."""
        self.costs.observe(num_tokens, seconds)

    def propose(self, running: Iterable[Sequence]) -> dict[str, list[int]]:
        """Request id -> drafted tokens, for the running sequences that decode next and may draft."""
        running = list(running)
        decoding = [seq for seq in running if seq.num_new_tokens_to_compute == 1]
        cost = self.costs.draft_cost(len(decoding))
        lengths = {}
        for seq in decoding:
            most = min(self.config.num_tokens, self._room(seq))
            length = draft_length(acceptance(seq), cost, most) if seq.params.speculate else 0
            if length:
                lengths[seq.request_id] = length
        if self.draft is not None:
            found = self.draft.propose(running, lengths)
        else:
            config = self.config
            by_id = {seq.request_id: seq for seq in decoding}
            found = {
                rid: ngram_proposal(by_id[rid].all_token_ids, length, config.ngram_max, config.ngram_min)
                for rid, length in lengths.items()
            }
        proposals: dict[str, list[int]] = {}
        for seq in decoding:
            drafts = found.get(seq.request_id, [])
            if seq.grammar is not None and drafts:
                # Drafts the grammar refuses could never be kept: they are not scored.
                drafts = drafts[: seq.grammar.valid_prefix(drafts)]
            if drafts:
                proposals[seq.request_id] = drafts
        return proposals

    def _room(self, seq: Sequence) -> int:
        """Drafts seq can use: the step's token is one of max_new_tokens and of the context, and the
        last token sampled is never cached, so a step may hold at most what is left less one."""
        left = seq.params.max_new_tokens - seq.num_output_tokens
        return max(0, min(left, self.max_model_len - seq.num_tokens) - 1)
