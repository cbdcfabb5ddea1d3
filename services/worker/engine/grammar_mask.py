"""The grammar mask of one step: every constrained row's disallowed logits set to -inf, in place.

Runs on the engine thread between the forward pass and the sampler, over the rows whose sequences
carry a grammar; a step without one never gets here. llguidance fills one bit per tokenizer id for
all rows at once (its executor's threads, with the GIL released, while torch's own threads are idle
between the two); numpy unpacks the bits, and the mask is as wide as the logits: ids past the
tokenizer's vocabulary (padding rows of the embedding) are always masked. Where the mask runs, and
what it costs, is measured in docs/structured-output.md. This module must not advance grammar state
(the scheduler does) nor sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch
from llguidance.torch import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

if TYPE_CHECKING:
    from collections.abc import Sequence

    from services.worker.engine.grammar_matcher import GrammarMatcher


@dataclass(slots=True)
class MaskStats:
    """Cumulative work, read by benchmarks and tests."""

    steps: int = 0
    rows: int = 0
    seconds: float = 0.0


class GrammarMasker:
    """Applies the grammar masks of a step's constrained rows. One per runner, used from one thread."""

    def __init__(self, threads: int | None = None) -> None:
        """threads: the library's mask threads; default torch's intra-op count (idle at that moment)."""
        self.executor = llguidance.LLExecutor(num_threads=threads or torch.get_num_threads())
        self._buffer = torch.zeros((0, 0), dtype=torch.int32)
        self.stats = MaskStats()

    def apply(self, logits: torch.Tensor, rows: Sequence[tuple[int, GrammarMatcher, Sequence[int]]]) -> None:
        """Mask logits [N, V] in place: rows[i] = (a constrained sequence's first row in logits, its
        grammar state, its drafts). A speculative decode's drafts have one row each after its first,
        masked for the state after the drafts before it; the library walks the drafts and rolls its
        matcher back, so the state is what it was (step_results.py advances it by the tokens kept)."""
        if not rows:
            return
        started = time.perf_counter()
        vocab = logits.shape[1]
        # The library writes exactly its tokenizer's words; every row's grammar shares one tokenizer.
        known = rows[0][1].vocab_size
        count = sum(1 + len(drafts) for _, _, drafts in rows)
        bitmask = self._bitmask(count, (known + 31) // 32)
        entries: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        at: list[int] = []
        for first, grammar, drafts in rows:
            entries.append((grammar.raw, len(at), list(drafts)))
            at.extend(range(first, first + 1 + len(drafts)))
        # The library takes drafts only where there are some: two calls, each filling its own rows.
        drafting = [entry for entry in entries if entry[2]]
        plain = [(raw, row) for raw, row, drafts in entries if not drafts]
        if drafting:
            fill_next_token_bitmask_par_with_draft_tokens(self.executor, drafting, bitmask)
        if plain:
            fill_next_token_bitmask_par(self.executor, plain, bitmask)
        # The inverted bits unpack to 0/1 bytes that are already a bool tensor's storage: no compare.
        inverted = np.invert(bitmask.numpy()).view(np.uint8)
        refused = torch.from_numpy(np.unpackbits(inverted, axis=1, count=known, bitorder="little")).view(
            torch.bool
        )
        if vocab > known:
            # Ids past the tokenizer's (padding rows of the embedding) are never allowed.
            padding = torch.ones((count, vocab - known), dtype=torch.bool)
            refused = torch.cat([refused, padding], dim=1)
        refused = refused.to(logits.device)
        if at == list(range(logits.shape[0])):
            logits.masked_fill_(refused, float("-inf"))  # every row constrained: in place, no copy
        else:
            index = torch.tensor(at, device=logits.device)
            logits[index] = logits[index].masked_fill(refused, float("-inf"))
        self.stats.steps += 1
        self.stats.rows += count
        self.stats.seconds += time.perf_counter() - started

    def _bitmask(self, rows: int, words: int) -> torch.Tensor:
        """A zeroed [rows, words] int32 view of a buffer kept across steps (grown, never shrunk)."""
        if self._buffer.shape[0] < rows or self._buffer.shape[1] != words:
            self._buffer = torch.zeros((max(rows, self._buffer.shape[0]), words), dtype=torch.int32)
        view = self._buffer[:rows]
        view.zero_()
        return view
