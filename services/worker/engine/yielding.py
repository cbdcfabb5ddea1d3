"""Which running sequences give way to more urgent waiting ones: their running slots, and their KV blocks.

A sequence's urgency is its priority (lower runs first: the gateway sends a tenant below its fair share
one step up, and interactive above batch), then its arrival. Without this a waiting sequence, however
urgent, waits for a running one to finish: one tenant whose long streams fill every running slot (or
every KV block) would hold a quiet tenant's first token for as long as those streams take. So each
waiting sequence, in admission order, that finds no free slot, or not the free blocks its prompt needs,
takes them from the least urgent running sequences (the youngest of the lowest priority first) that
are strictly less urgent than it: they are preempted by recompute, and the blocks their prompts and
outputs filled stay in the prefix cache, so they resume from them when room frees. Equal priorities
never preempt each other, so one tenant's requests never churn among themselves. The blocks a victim
frees are counted as its whole table (a block another sequence shares stays taken, so the count may be
short: the waiting sequence then takes another step and another victim); the blocks the running
sequences take this step to grow are not free for it.

This module only chooses: the scheduler preempts the sequences it names. It reads the block manager and
must not change it nor the queues, nor import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable
    from collections.abc import Sequence as SequenceOf

    from services.worker.engine.block_manager import BlockManager
    from services.worker.engine.sequence import Sequence


def yielding(
    waiting: Iterable[Sequence], running: SequenceOf[Sequence], max_running: int, blocks: BlockManager
) -> list[Sequence]:
    """The running sequences to preempt so that the waiting ones, in admission order, find a slot and
    the blocks for what they compute when they are more urgent than a running one; the least urgent
    first."""
    candidates = sorted(running, key=lambda seq: (seq.priority, seq.arrival), reverse=True)
    room = max_running - len(candidates)
    free_blocks = blocks.num_free_blocks
    free_blocks -= sum(blocks.blocks_to_grow(seq, seq.num_computed_tokens + 1) for seq in running)
    victims: list[Sequence] = []
    for seq in waiting:
        need = blocks.blocks_needed(seq.num_new_tokens_to_compute)
        while room <= 0 or need > free_blocks:
            if len(victims) == len(candidates) or candidates[len(victims)].priority <= seq.priority:
                return victims
            victim = candidates[len(victims)]
            victims.append(victim)
            room += 1
            free_blocks += len(victim.block_table)
        room -= 1
        free_blocks -= need
    return victims
