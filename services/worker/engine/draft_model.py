"""Draft-model proposals: a smaller model with the target's tokenizer drafts each sequence's next tokens.

The draft runs in the engine's process and thread, with its own runner, KV cache and block manager: as
many blocks as the target's cache, each holding the same tokens (memory_profile.py counts both caches'
bytes per block in the memory budget). Each running sequence it drafts for has a mirror here: a
Sequence of the same prompt, output, params and seed, whose K/V the draft's cache holds up to the
mirror's computed tokens. A step first brings each mirror up to its sequence (the tokens kept since
its last draft, usually a few, as one chunk of at most the step budget) and samples the first draft
from the chunk's last position, then drafts the rest one decode at a time, every mirror in one batch.
Drafts are drawn as the target draws, through the same sampler at the same output positions with the
same seed and processors, so where the two models agree the draft is the very token the target picks.
A mirror is dropped with its blocks when its request ends (the engine says so) or is found not
running. `load_draft` loads the draft beside the target and checks their tokenizers agree. This
module must not touch the target's sequences or cache: it reads the sequences and proposes.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.cost_line import StepCostModel
from services.worker.engine.model_runner import ModelRunner
from services.worker.engine.sequence import ScheduledBatch, ScheduledEntry, Sequence
from services.worker.model.loader import load_model
from strata.fingerprint import tokenizer_fingerprint

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from services.worker.engine.config import SpeculativeConfig
    from services.worker.model.loader import LoadedModel


def load_draft(loaded: LoadedModel, config: SpeculativeConfig) -> LoadedModel | None:
    """The draft model of method "draft", on the served model's device and in its dtype; its
    tokenizer must be the served model's (a draft token must mean the same text)."""
    if config.method != "draft" or config.draft_model_path is None:
        return None
    draft = load_model(config.draft_model_path, device=str(loaded.device), dtype=loaded.dtype)
    ours, theirs = tokenizer_fingerprint(loaded.path), tokenizer_fingerprint(draft.path)
    if ours != theirs:
        raise ValueError(
            f"engine.speculative.draft_model_path={config.draft_model_path!r} has another tokenizer "
            f"({theirs}) than the served model {loaded.path} ({ours}): choose a draft model of the same "
            "family and tokenizer, e.g. Qwen2.5-Coder-0.5B-Instruct for Qwen2.5-Coder-1.5B-Instruct"
        )
    return draft


class DraftModel:
    """Drafts tokens for the target's decoding sequences. Used from the engine thread only."""

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, step_budget: int, vocab_size: int
    ) -> None:
        """step_budget: most tokens a mirror catches up in one step (the target's step budget, which
        bounds the step's memory); vocab_size: the target's, past which no draft is proposed."""
        self.vocab_size = vocab_size
        self.runner = ModelRunner(loaded, num_blocks, block_size, use_cuda_graphs=False)
        self.blocks = BlockManager(num_blocks, block_size)
        self.step_budget = step_budget
        self._mirrors: dict[str, Sequence] = {}
        self._steps = 0
        self.costs = StepCostModel()
        """The draft's passes, seconds against tokens: what finding a draft costs (speculation.py)."""

    @property
    def num_mirrors(self) -> int:
        return len(self._mirrors)

    def propose(self, running: Iterable[Sequence], lengths: Mapping[str, int]) -> dict[str, list[int]]:
        """Request id -> up to lengths[id] drafted tokens, for running sequences with a length > 0."""
        alive = {seq.request_id: seq for seq in running}
        # A preempted sequence's mirror goes too (its blocks may be needed); it is rebuilt on return.
        for rid in [rid for rid in self._mirrors if rid not in alive]:
            self.release(rid)
        mirrors: list[tuple[Sequence, int]] = []
        for rid, count in lengths.items():
            mirror = self._sync(alive[rid])
            if mirror is not None and count > 0 and self._fits(mirror, count):
                mirrors.append((mirror, count))
        if not mirrors:
            return {}
        self._catch_up([mirror for mirror, _ in mirrors])
        for position in range(1, max(count for _, count in mirrors)):
            self._decode([mirror for mirror, count in mirrors if count > position])
        found = {}
        for mirror, _ in mirrors:
            drafts = mirror.output_ids[len(alive[mirror.request_id].output_ids) :]
            # The same tokenizer, but an embedding may be padded wider: an id the target has no row
            # for ends the drafts.
            valid = next((i for i, token in enumerate(drafts) if token >= self.vocab_size), len(drafts))
            found[mirror.request_id] = drafts[:valid]
        return found

    def _sync(self, seq: Sequence) -> Sequence | None:
        """seq's mirror, its output set to seq's and its computed tokens cut to the prefix it shares
        with seq; None while it is more than a step's budget behind (it catches up, drafting nothing)."""
        mirror = self._mirrors.get(seq.request_id)
        if mirror is None:
            # The draft's logprobs are nobody's: only the sampling parameters are the sequence's.
            params = replace(seq.params, logprobs=None, prompt_logprobs=None)
            mirror = Sequence(seq.request_id, seq.prompt_ids, params, seed=seq.seed)
            self._mirrors[seq.request_id] = mirror
        computed = min(mirror.num_computed_tokens, seq.num_tokens - 1)
        split = len(seq.prompt_ids)
        for index in range(split, computed):
            if mirror.output_ids[index - split] != seq.output_ids[index - split]:
                computed = index
                break
        mirror.output_ids = list(seq.output_ids)
        mirror.num_computed_tokens = computed
        behind = mirror.num_tokens - computed
        if behind > self.step_budget:
            self._advance(mirror, self.step_budget)
            return None
        return mirror

    def _fits(self, mirror: Sequence, count: int) -> bool:
        """Take the blocks for the mirror's tokens and its drafts but the last (never fed back)."""
        target = mirror.num_tokens + count - 1
        if not self.blocks.can_grow(mirror, target):
            return False
        self.blocks.allocate_for(mirror, target)
        return True

    def _advance(self, mirror: Sequence, count: int) -> None:
        """Compute count more of a far-behind mirror's tokens, sampling nothing."""
        if not self.blocks.can_grow(mirror, mirror.num_computed_tokens + count):
            return
        self.blocks.allocate_for(mirror, mirror.num_computed_tokens + count)
        start = mirror.num_computed_tokens
        entry = ScheduledEntry(mirror, start, count, mirror.token_slice(start, start + count), False)
        self._run([entry], num_decodes=0)

    def _catch_up(self, mirrors: list[Sequence]) -> None:
        """Each mirror's uncomputed tokens in one step (one-token ones as decodes, first), and the first
        draft of each from its last position."""
        entries = []
        for mirror in mirrors:
            start = mirror.num_computed_tokens
            tokens = mirror.token_slice(start, mirror.num_tokens)
            entries.append(ScheduledEntry(mirror, start, len(tokens), tokens, True))
        entries.sort(key=lambda entry: entry.num_tokens > 1)
        self._run(entries, num_decodes=sum(1 for entry in entries if entry.num_tokens == 1))

    def _decode(self, mirrors: list[Sequence]) -> None:
        entries = [
            ScheduledEntry(
                m, m.num_computed_tokens, 1, m.token_slice(m.num_computed_tokens, m.num_tokens), True
            )
            for m in mirrors
        ]
        self._run(entries, num_decodes=len(entries))

    def _run(self, entries: list[ScheduledEntry], num_decodes: int) -> None:
        self._steps += 1
        batch = ScheduledBatch(self._steps, entries, num_decodes)
        started = time.perf_counter()
        sampled = iter(self.runner.run(batch))
        self.costs.observe(batch.num_batched_tokens, time.perf_counter() - started)
        for entry in entries:
            entry.seq.num_computed_tokens += entry.num_tokens
            if entry.sample:
                entry.seq.output_ids.append(next(sampled))

    def release(self, request_id: str) -> None:
        """Drop the request's mirror and its blocks, if it has one."""
        mirror = self._mirrors.pop(request_id, None)
        if mirror is not None and self.blocks.holds(mirror):
            self.blocks.free(mirror)
