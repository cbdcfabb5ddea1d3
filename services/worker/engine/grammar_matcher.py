"""One sequence's grammar state: which tokens may come next, advanced by each token it accepts.

A GrammarMatcher wraps an llguidance matcher copied from the compiler's cached prototype. The
scheduler advances it with every sampled token (in postprocess) and asks whether the grammar is
complete; the mask builder reads its matcher to fill the sequence's row of the step's bitmask.
Preemption does not touch it: the output ids it consumed stay the sequence's own, so the state is
still theirs when the sequence resumes. A failover's prior output is replayed into it at admission.
This module must not import torch nor touch logits (grammar_mask.py does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    import llguidance

    from services.worker.engine.grammar_spec import GrammarSpec


class GrammarMatcher:
    """The grammar state of one sequence. Used from the engine thread only, after construction."""

    __slots__ = ("_matcher", "spec", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, spec: GrammarSpec, vocab_size: int) -> None:
        """`vocab_size`: ids the grammar's tokenizer knows; logits wider than that are padding."""
        self._matcher = matcher
        self.spec = spec
        self.vocab_size = vocab_size

    @property
    def raw(self) -> llguidance.LLMatcher:
        """The library's matcher, for the batched mask fill."""
        return self._matcher

    def advance(self, token: int) -> bool:
        """Accept one sampled token; False when the grammar refuses it (the state is then an error)."""
        return bool(self._matcher.consume_token(token))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the grammar would accept from here, without advancing (a
        speculative decode's drafts are cut there before the model scores them)."""
        return int(self._matcher.validate_tokens(list(tokens)))

    def replay(self, tokens: Sequence[int]) -> bool:
        """Accept tokens generated before this matcher existed (a failover's prior output)."""
        return all(self.advance(token) for token in tokens)

    @property
    def is_complete(self) -> bool:
        """The grammar can take no more tokens (only end-of-sequence): the output is finished."""
        return bool(self._matcher.is_stopped()) and not self._matcher.is_error()

    @property
    def error(self) -> str:
        """Why the matcher refused a token; empty when it did not."""
        return str(self._matcher.get_error()) if self._matcher.is_error() else ""
