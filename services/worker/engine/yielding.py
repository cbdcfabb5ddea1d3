"""Which running sequences give way to a more urgent waiting one of another tenant: slots and KV blocks.

Without this a waiting sequence, however urgent, waits for a running one to finish: one tenant whose
long streams fill every running slot (or every KV block) would hold another tenant's first token for as
long as those streams take. A sequence's tenant here is its cache salt (the gateway salts each tenant's
prompts); its urgency is its priority (lower runs first: the gateway sends a tenant below its fair share
one step up, and interactive above batch).

Each waiting sequence, in admission order, that finds no free slot, or not the free blocks its first
chunk needs (what admission will take: its prompt past the cached prefix, at most one step's tokens),
may take them from running sequences that are less urgent than it and belong to the tenant holding the
most running slots, as long as that tenant holds at least two more than the waiting one's: the youngest
such sequence first, preempted by recompute (the blocks its prompt and output filled stay in the prefix
cache, so it resumes from them when room frees). So running slots move towards an even split among the
tenants with work here and no further: one tenant never preempts its own sequences, two busy tenants
stop preempting each other once even, and a deployment of one tenant never preempts for this. Victims
are taken only when they free enough for the waiting sequence; otherwise none is, and the admission
order holds. A victim's blocks count as its whole table (a block another sequence shares stays taken,
so the waiting sequence may need another step), and the blocks the running sequences take this step to
grow are not free for it.

This module only chooses: the scheduler preempts the sequences it names. It reads the block manager and
must not change it nor the queues, nor import torch.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from services.worker.engine.block_manager import NO_HIT

if TYPE_CHECKING:
    from collections.abc import Iterable
    from collections.abc import Sequence as SequenceOf

    from services.worker.engine.block_manager import BlockManager
    from services.worker.engine.sequence import Sequence


def yielding(
    waiting: Iterable[Sequence],
    running: SequenceOf[Sequence],
    max_running: int,
    blocks: BlockManager,
    chunk_tokens: int,
) -> list[Sequence]:
    """The running sequences to preempt so that the waiting ones, in admission order, find a slot and
    the blocks of a first chunk of at most `chunk_tokens`; the order they were chosen in."""
    held = Counter(seq.cache_salt for seq in running)
    waiting = list(waiting)
    if len(held) == 0 or (len(held) == 1 and all(seq.cache_salt in held for seq in waiting)):
        return []  # no other tenant to take from: the step pays no prefix lookups for nothing
    room = max_running - len(running)
    free = blocks.num_free_blocks
    free -= sum(blocks.blocks_to_grow(seq, seq.num_computed_tokens + 1) for seq in running)
    victims: list[Sequence] = []
    for seq in waiting:
        need = _first_chunk_blocks(seq, blocks, chunk_tokens)
        counts, slots, spare = held.copy(), room, free
        chosen: list[Sequence] = []
        while slots <= 0 or need > spare:
            victim = _victim(seq, running, counts, {*victims, *chosen})
            if victim is None:
                return victims
            chosen.append(victim)
            counts[victim.cache_salt] -= 1
            slots += 1
            spare += len(victim.block_table)
        victims += chosen
        held, room, free = counts, slots - 1, spare - need
        held[seq.cache_salt] += 1
    return victims


def _first_chunk_blocks(seq: Sequence, blocks: BlockManager, chunk_tokens: int) -> int:
    """The free blocks admitting `seq` takes (as the scheduler's admission counts them)."""
    hit = NO_HIT if seq.needs_prompt_logits else blocks.cached_prefix(seq)
    cached = len(hit.blocks) * blocks.block_size
    chunk = min(seq.num_new_tokens_to_compute - cached, chunk_tokens)
    return blocks.blocks_needed(cached + chunk) - len(hit.blocks) + hit.num_evictable


def _victim(
    seq: Sequence, running: SequenceOf[Sequence], counts: Counter[str], taken: set[Sequence]
) -> Sequence | None:
    """The youngest of the least urgent running sequences, less urgent than `seq`, of the tenant
    holding the most running slots when it holds at least two more than `seq`'s; None when there is none."""
    floor = counts[seq.cache_salt] + 1
    candidates = [
        other
        for other in running
        if other not in taken and other.priority > seq.priority and counts[other.cache_salt] > floor
    ]
    if not candidates:
        return None
    most = max(counts[other.cache_salt] for other in candidates)
    return max(
        (other for other in candidates if counts[other.cache_salt] == most),
        key=lambda other: (other.priority, other.arrival),
    )
