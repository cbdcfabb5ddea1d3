"""What one schedule() call builds and what the scheduler reports: the batch and the stats snapshot.

BatchBuilder is a batch being built with the step's remaining token budget; SchedulerStats is the
snapshot of queues, KV cache and counters the engine hands to other threads. This module only
describes records: it must not decide what runs (scheduler.py does) nor take KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.worker.engine.sequence import ScheduledBatch, ScheduledEntry

if TYPE_CHECKING:
    from services.worker.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of the queues, the KV cache and the counters since start."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    """Free plus evictable blocks: a cached block nobody references is capacity, not load."""
    free_kv_tokens: int
    total_kv_tokens: int
    kv_cache_usage: float
    num_steps: int
    num_preemptions: int
    num_load_sheds: int
    effective_max_num_seqs: int
    prefill_budget: int
    """Prompt tokens the next step may compute with the sequences now running all decoding."""
    num_cached_blocks: int
    """Blocks in the prefix cache's index, referenced or not."""
    num_evictable_blocks: int
    """Cached blocks no sequence references (counted in num_free_blocks too)."""
    num_evictions: int
    prefix_query_blocks: int
    """Full prompt blocks that new requests could have found cached (the last token's aside)."""
    prefix_hit_blocks: int
    """Of those, the blocks the prefix cache served."""
    num_draft_tokens: int
    """Speculative tokens scored since start."""
    num_accepted_tokens: int
    """Of those, the ones kept (each saved a step's read of the weights)."""
    num_speculative_decodes: int
    """Decodes that scored drafts since start (accepted tokens per such decode: their ratio)."""


class BatchBuilder:
    """A batch being built, with the step's remaining token budget."""

    def __init__(self, step_id: int, budget: int) -> None:
        self.batch = ScheduledBatch(step_id)
        self.budget = budget
        self.scheduled: set[str] = set()

    def add(self, seq: Sequence, num_tokens: int, *, decode: bool) -> None:
        start = seq.num_computed_tokens
        end = start + num_tokens
        entry = ScheduledEntry(seq, start, num_tokens, seq.token_slice(start, end), end == seq.num_tokens)
        self.batch.entries.append(entry)
        self.batch.num_decodes += decode
        self.budget -= num_tokens
        self.scheduled.add(seq.request_id)

    def speculate(self, index: int, drafts: list[int]) -> None:
        """Make decode entry `index` also score `drafts`, the tokens proposed to follow its last one."""
        entry = self.batch.entries[index]
        if entry.num_tokens != 1 or not entry.sample:
            raise ValueError(f"entry {index} of step {self.batch.step_id} is not a plain decode")
        tokens = entry.token_ids + drafts
        self.batch.entries[index] = ScheduledEntry(
            entry.seq, entry.start, len(tokens), tokens, True, len(drafts)
        )
        self.budget -= len(drafts)
