"""One request's state inside the engine, and the records an engine step passes around.

A Sequence is the scheduler's unit of work. It records which tokens exist (the prompt, then the
output), how many of them already have K/V in the cache, and which cache blocks hold them. A
ScheduledBatch is one step's work as the scheduler hands it to the runner; a StepOutput is what the
step produced for one sequence. This module must not import torch nor do I/O: the scheduler and
block manager are tested alone with it, and the runner reads these records without the scheduler.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strata.sampling import InvalidRequestError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from services.worker.engine.grammar_matcher import GrammarMatcher
    from strata.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    """EOS or one of the request's stop token ids."""
    LENGTH = "length"
    """max_new_tokens reached, or the context limit."""
    ABORTED = "aborted"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position's log probabilities: its token's, its rank, and the `top` most likely (id, logprob)."""

    token_id: int
    logprob: float
    rank: int
    """1 for the most likely token."""
    top: tuple[tuple[int, float], ...] = ()


class Sequence:
    """A prompt, the tokens generated so far, and how much of it is in the KV cache.

    num_computed_tokens counts the leading tokens whose K/V are cached; the rest must be computed
    before the next token can be sampled. Preemption by recompute resets it to 0 and drops
    block_table, keeping output_ids, so the output resumes exactly where it stopped (and the prefix
    cache usually gives it its own blocks back). block_hashes holds the chained hashes of its first
    full blocks, computed once (tokens at a position never change); num_committed_blocks counts the
    leading blocks of its table the block manager has offered to the prefix cache.
    """

    __slots__ = (
        "adapter",
        "arrival",
        "block_hashes",
        "block_table",
        "cache_salt",
        "finish_reason",
        "grammar",
        "itl_slo_s",
        "num_accepted_drafts",
        "num_cached_tokens",
        "num_committed_blocks",
        "num_computed_tokens",
        "num_draft_trials",
        "num_preemptions",
        "output_ids",
        "params",
        "priority",
        "prompt_ids",
        "prompt_logprobs",
        "request_id",
        "seed",
        "status",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: Iterable[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival: int = 0,
        seed: int | None = None,
        cache_salt: str = "",
        grammar: GrammarMatcher | None = None,
        itl_slo_s: float | None = None,
        adapter: str = "",
    ) -> None:
        """cache_salt: who may share this sequence's cached blocks (the tenant); "" shares with all
        sequences of salt "" only. grammar: the output constraint's state, advanced by every token.
        itl_slo_s: the inter-token latency its route promises (step_limits.py keeps steps within it).
        adapter: the LoRA adapter it runs through ("" for the base model)."""
        self.request_id = request_id
        self.prompt_ids: list[int] = list(prompt_ids)
        if not self.prompt_ids:
            raise InvalidRequestError("prompt", "<empty>", "the prompt must hold at least one token")
        self.params = params
        self.priority = priority
        self.arrival = arrival
        # The facade fills params.seed; the request-id hash only keeps bare tests reproducible.
        if seed is None:
            seed = params.seed if params.seed is not None else zlib.crc32(request_id.encode())
        self.seed: int = seed
        self.output_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.cache_salt = cache_salt
        self.block_hashes: list[int] = []
        self.num_committed_blocks = 0
        self.num_cached_tokens = 0
        """Prompt tokens the prefix cache served at its first admission (Usage's cached_input_tokens)."""
        self.grammar = grammar
        self.itl_slo_s = itl_slo_s
        self.adapter = adapter
        self.prompt_logprobs: list[TokenLogprobs] = []
        """With params.prompt_logprobs: entry j is prompt token j + 1's, filled as prefill runs."""
        self.num_draft_trials = 0
        self.num_accepted_drafts = 0

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt positions still need their logits: such a prefill never reads the cache."""
        wanted = self.params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    def keep_prompt_logprobs(self, start: int, found: list[TokenLogprobs]) -> None:
        """Keep a chunk's prompt logprobs (positions start, ...) not kept yet: a prefix recomputed after
        preemption is not kept twice."""
        skip = len(self.prompt_logprobs) - start
        if 0 <= skip < len(found):
            self.prompt_logprobs.extend(found[skip:])

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list: the prompt followed by the output so far."""
        return self.prompt_ids + self.output_ids

    @property
    def num_new_tokens_to_compute(self) -> int:
        """Tokens to run through the model before the next token can be sampled (1 when decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, without copying the whole sequence."""
        split = len(self.prompt_ids)
        if end <= split:
            return self.prompt_ids[start:end]
        if start >= split:
            return self.output_ids[start - split : end - split]
        return self.prompt_ids[start:] + self.output_ids[: end - split]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, priority={self.priority}, arrival={self.arrival})"
        )


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one engine step produced for one sequence: its new tokens and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    """Prompt tokens the prefix cache served instead of computing them."""
    logprobs: list[TokenLogprobs] | None = None
    """With params.logprobs: one entry per new token."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With params.prompt_logprobs: on the first output only, one entry per prompt token after the first."""
    num_drafted: int = 0
    """Speculative tokens this step scored for the sequence."""
    num_accepted: int = 0
    """Of those, the ones its model agreed with (each is one of new_token_ids)."""


@dataclass(frozen=True, slots=True)
class ScheduledEntry:
    """One sequence's share of a step: tokens [start, start + num_tokens) go through the model.

    A speculative decode's token_ids are its last token then num_drafts proposed ones (not yet its
    output): each of its num_tokens positions is sampled, one row each, and step_results.py keeps
    the drafts its model agrees with.
    """

    seq: Sequence
    start: int
    num_tokens: int
    token_ids: list[int]
    sample: bool
    """True iff all of the sequence's tokens are computed after this step, so it yields a token."""
    num_drafts: int = 0

    @property
    def drafts(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_drafts :]

    @property
    def num_sampled_rows(self) -> int:
        """Rows of logits this entry samples: one per position for a speculative decode."""
        return 1 + self.num_drafts if self.sample else 0


@dataclass(slots=True)
class ScheduledBatch:
    """The work of one engine step: decodes first (one token each, or a speculative decode's last
    token and drafts), then prefill chunks. num_decodes counts the decode entries."""

    step_id: int
    entries: list[ScheduledEntry] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    @property
    def num_samples(self) -> int:
        """Rows of logits the step samples (a speculative decode samples each of its positions)."""
        return sum(e.num_sampled_rows for e in self.entries)

    @property
    def is_empty(self) -> bool:
        return not self.entries
