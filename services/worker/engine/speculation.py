"""Speculative decoding's decisions: which decoding sequences draft, how many tokens, and what.

A decode reads every weight to produce one token; a step that scores a sequence's last token and k
drafted ones reads them once for k + 1 positions. The model's own choice at each position decides:
drafts are kept while they equal what it picks, and the position after the last kept one gives one
more token (accepted_tokens). Its pick is the sampler's seeded draw, a function of the position's
logits, seed and output position alone, so the output is the very tokens the sequence would get
without speculation, greedy or sampled: the target distribution is kept exactly, token for token.

The draft length is a rule, not a switch (docs/speculative-decoding.md): a step's seconds are fitted
as a + b * tokens over the recent steps (StepCostModel), so at B decoding sequences a token costs
(a + b * B) / B on average and each drafted token costs b more to score. A draft model's passes are
fitted the same way (draft_model.py), a_d + b_d * tokens, and one pass drafts a token for each of the
B sequences, so finding each costs (a_d + b_d * B) / B; prompt lookup's is nothing next to a step.
The j-th draft of a sequence is taken while its chance of being kept, alpha ** j (alpha: the
sequence's measured per-draft acceptance, started from an even prior), is at least c, a drafted
token's cost over the average token's: c = (b * B + a_d + b_d * B) / (a + b * B). What it buys must
pay what it costs. At one stream of prompt lookup c is small (the weights' read dominates a); at 64
busy streams it is near 1 and nobody drafts; a draft model whose pass costs most of a target step
puts it near 1 at one stream too. This module must not schedule, take blocks nor sample: it proposes
(ngram.py finds the tokens), the scheduler fits what it can, the runner scores, step_results.py keeps
the accepted ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.engine.cost_line import StepCostModel
from services.worker.engine.ngram import ngram_proposal

if TYPE_CHECKING:
    from collections.abc import Iterable
    from collections.abc import Sequence as SequenceOf

    from services.worker.engine.config import SpeculativeConfig
    from services.worker.engine.draft_model import DraftModel
    from services.worker.engine.sequence import Sequence

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
        cost = self.costs.draft_cost(len(decoding), self.draft.costs if self.draft is not None else None)
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
