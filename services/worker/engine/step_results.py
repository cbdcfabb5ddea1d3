"""A finished step applied to its sequences: what each computed, the token it sampled, whether it ends.

For every entry of a ScheduledBatch that still runs, apply_step advances its computed tokens, offers
its newly full blocks to the prefix cache (before anything can free them), keeps the prompt logprobs
the runner computed, appends the sampled token, decides whether the sequence ends (its grammar
first, then StopRule: EOS and stop tokens, max_new_tokens, the context limit) and describes it as a
StepOutput. An entry aborted while the step ran is dropped. This module must not pick work, preempt
nor free blocks: a sequence that ends goes back through `finish`, the scheduler's, which owns the
queues. Like the scheduler it imports no torch and does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.worker.engine.sequence import FinishReason, SequenceStatus, StepOutput

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
    """Apply a finished step: sampled holds one token id per entry with sample=True, in order;
    logprobs (aligned with it) and prompt_logprobs (by entry index) what the runner computed."""
    if len(sampled) != batch.num_samples:
        raise ValueError(f"step {batch.step_id}: {len(sampled)} sampled tokens for {batch.num_samples}")
    outputs: list[StepOutput] = []
    tokens = iter(sampled)
    token_lps = iter(logprobs if logprobs is not None else [None] * len(sampled))
    for index, entry in enumerate(batch.entries):
        seq = entry.seq
        token = next(tokens) if entry.sample else None
        token_lp = next(token_lps) if entry.sample else None
        if seq.is_finished:
            continue  # aborted while the step ran: its result is dropped
        if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != entry.start:
            raise RuntimeError(f"step {batch.step_id} is stale for {seq!r} (postprocessed twice?)")
        seq.num_computed_tokens += entry.num_tokens
        # Before the sequence can finish and free them: its full blocks are shareable from now.
        block_manager.commit(seq)
        if prompt_logprobs and index in prompt_logprobs:
            seq.keep_prompt_logprobs(entry.start, prompt_logprobs[index])
        if token is None:
            continue
        first = not seq.output_ids
        seq.output_ids.append(token)
        # The grammar first: a token that completes it ends the output even at max_new_tokens.
        reason = seq.grammar.finish_after(token) if seq.grammar is not None else None
        reason = reason or stop.reason(seq, token)
        if reason is not None:
            finish(seq, reason)
        outputs.append(
            StepOutput(
                request_id=seq.request_id,
                new_token_ids=[token],
                finished=reason is not None,
                finish_reason=reason,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens,
                num_cached_tokens=seq.num_cached_tokens,
                logprobs=None if token_lp is None else [token_lp],
                prompt_logprobs=seq.prompt_logprobs
                if first and seq.params.prompt_logprobs is not None
                else None,
            )
        )
    return outputs
