"""A finished step applied to its sequences: what each computed, the token it sampled, whether it ends.

For every entry of a ScheduledBatch that still runs, apply_step advances its computed tokens, offers
its newly full blocks to the prefix cache (before anything can free them), keeps the prompt logprobs
the runner computed, appends the sampled token (a speculative decode's accepted drafts and the token
after them), decides whether the sequence ends at each token (its grammar first, then StopRule: EOS
and stop tokens, max_new_tokens, the context limit) and describes it as a StepOutput. An entry aborted
while the step ran is dropped. This module must not pick work, preempt nor free blocks: a sequence
that ends goes back through `finish`, the scheduler's, which owns the queues. Like the scheduler it
imports no torch and does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.worker.engine.sequence import FinishReason, SequenceStatus, StepOutput
from services.worker.engine.speculation import accepted_tokens

if TYPE_CHECKING:
    from collections.abc import Callable
    from collections.abc import Sequence as SequenceOf

    from services.worker.engine.block_manager import BlockManager
    from services.worker.engine.sequence import ScheduledBatch, Sequence, TokenLogprobs


@dataclass(frozen=True, slots=True)
class StopRule:
    """When a sampled token ends its sequence, apart from the sequence's grammar."""

    eos_token_ids: frozenset[int]
    max_model_len: int
    """The context limit, already resolved by the scheduler's caller."""

    def reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why `token`, just appended to seq's output, ends it; None when it goes on."""
        params = seq.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def apply_step(
    batch: ScheduledBatch,
    sampled: SequenceOf[int],
    *,
    block_manager: BlockManager,
    stop: StopRule,
    finish: Callable[[Sequence, FinishReason], None],
    logprobs: SequenceOf[TokenLogprobs | None] | None = None,
    prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None,
) -> list[StepOutput]:
    """Apply a finished step: sampled holds one token id per sampled row (ScheduledEntry's
    num_sampled_rows per entry), in order; logprobs (aligned with it) and prompt_logprobs (by entry
    index) what the runner computed."""
    if len(sampled) != batch.num_samples:
        raise ValueError(f"step {batch.step_id}: {len(sampled)} sampled tokens for {batch.num_samples}")
    outputs: list[StepOutput] = []
    tokens = iter(sampled)
    token_lps = iter(logprobs if logprobs is not None else [None] * len(sampled))
    for index, entry in enumerate(batch.entries):
        seq = entry.seq
        rows = entry.num_sampled_rows
        samples = [next(tokens) for _ in range(rows)]
        row_lps = [next(token_lps) for _ in range(rows)]
        if seq.is_finished:
            continue  # aborted while the step ran: its result is dropped
        if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != entry.start:
            raise RuntimeError(f"step {batch.step_id} is stale for {seq!r} (postprocessed twice?)")
        new = accepted_tokens(entry.drafts, samples) if entry.num_drafts else samples
        if not entry.num_drafts:
            seq.num_computed_tokens += entry.num_tokens
        if prompt_logprobs and index in prompt_logprobs:
            seq.keep_prompt_logprobs(entry.start, prompt_logprobs[index])
        if not new:
            block_manager.commit(seq)
            continue
        first = not seq.output_ids
        kept, reason = _append(seq, new, stop)
        if entry.num_drafts:
            # Its last token and the drafts kept have their K/V now, every output token but the
            # newest (as after a decode); rejected drafts' slots are the next step's to overwrite.
            seq.num_computed_tokens = seq.num_tokens - 1
            accepted = len(new) - 1
            seq.num_accepted_drafts += accepted
            seq.num_draft_trials += accepted + (accepted < entry.num_drafts)
        # Before the sequence can finish and free them: its full blocks are shareable from now.
        block_manager.commit(seq)
        if reason is not None:
            finish(seq, reason)
        lps = row_lps[: len(kept)]
        outputs.append(
            StepOutput(
                request_id=seq.request_id,
                new_token_ids=kept,
                finished=reason is not None,
                finish_reason=reason,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens,
                num_cached_tokens=seq.num_cached_tokens,
                logprobs=None if lps[0] is None else [lp for lp in lps if lp is not None],
                prompt_logprobs=seq.prompt_logprobs
                if first and seq.params.prompt_logprobs is not None
                else None,
                num_drafted=entry.num_drafts,
                num_accepted=len(new) - 1 if entry.num_drafts else 0,
            )
        )
    return outputs


def _append(seq: Sequence, new: list[int], stop: StopRule) -> tuple[list[int], FinishReason | None]:
    """Append new tokens to seq's output up to the first that ends it; return those and why it ends."""
    for count, token in enumerate(new, 1):
        seq.output_ids.append(token)
        # The grammar first: a token that completes it ends the output even at max_new_tokens.
        reason = _grammar_reason(seq, token) or stop.reason(seq, token)
        if reason is not None:
            return new[:count], reason
    return new, None


def _grammar_reason(seq: Sequence, token: int) -> FinishReason | None:
    """Advance the sequence's grammar by a sampled token: STOP when it completes the grammar, ERROR
    when the grammar refuses it (only a row whose every allowed logit was -inf or NaN can sample one)."""
    if seq.grammar is None:
        return None
    if not seq.grammar.advance(token):
        return FinishReason.ERROR
    return FinishReason.STOP if seq.grammar.is_complete else None
