"""Paged KV cache bookkeeping: which fixed-size block belongs to which sequence, and which are free.

The block count is fixed at start; the tensors themselves live in the model runner, which reads each
sequence's block_table. This module owns only the accounting (free list, owners, credits) and checks
it exactly: freeing twice or freeing someone else's block raises. It must not import torch nor do I/O.

The free list is LIFO: the block freed last is handed out first. Its memory was touched most
recently, so it is the likeliest to still be warm in CPU caches and resident pages, and the working
set stays compact when the cache is mostly idle. FIFO only pays off with prefix caching, where a freed
block's contents may be reused; this engine has none.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from services.worker.engine.sequence import Sequence


class BlockAccountingError(RuntimeError):
    """A programming error: a double free, a foreign block, or counts that do not add up."""


class NoFreeBlocksError(RuntimeError):
    """allocate_for was asked for more blocks than are free; callers check can_grow first."""


class BlockManager:
    """Hands out KV cache blocks to sequences and takes them back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: the KV cache needs at least one block")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Reversed so that pop() hands out block 0 first: tables read naturally in logs and tests.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owner: list[str | None] = [None] * num_blocks
        self._held: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def free_tokens(self) -> int:
        """The credits this worker publishes: tokens that fit in the free blocks."""
        return len(self._free) * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, for the KV cache usage gauge."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a sequence holding no blocks could cache num_tokens now."""
        return self.blocks_needed(num_tokens) <= len(self._free)

    def blocks_to_grow(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq must gain so that its table covers num_tokens tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_to_grow(seq, num_tokens) <= len(self._free)

    def capacity_for(self, seq: Sequence) -> int:
        """Most tokens seq could cover now: its own blocks plus every free one."""
        return (len(seq.block_table) + len(self._free)) * self.block_size

    def holds(self, seq: Sequence) -> bool:
        return seq.request_id in self._held

    def allocate_for(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Grow seq's block table to cover num_tokens tokens; return the blocks added (maybe none)."""
        rid = seq.request_id
        if self._held.get(rid, 0) != len(seq.block_table):
            raise BlockAccountingError(
                f"sequence {rid!r} has {len(seq.block_table)} blocks in its table but the manager "
                f"gave it {self._held.get(rid, 0)}"
            )
        need = self.blocks_to_grow(seq, num_tokens)
        if need == 0:
            return []
        if need > len(self._free):
            raise NoFreeBlocksError(
                f"sequence {rid!r} needs {need} more blocks for {num_tokens} tokens; {len(self._free)} free"
            )
        new = [self._free.pop() for _ in range(need)]
        for block in new:
            self._owner[block] = rid
        seq.block_table.extend(new)
        self._held[rid] = self._held.get(rid, 0) + need
        return new

    def free(self, seq: Sequence) -> int:
        """Return all of seq's blocks to the free list; return how many. Raises on any inconsistency."""
        rid = seq.request_id
        held = self._held.get(rid)
        if held is None:
            raise BlockAccountingError(f"free({rid!r}): it holds no blocks (freed twice?)")
        table = seq.block_table
        if held != len(table) or len(set(table)) != len(table):
            raise BlockAccountingError(
                f"free({rid!r}): its table {table} does not match the {held} blocks it was given"
            )
        for block in table:
            if not 0 <= block < self.num_blocks or self._owner[block] != rid:
                owner = self._owner[block] if 0 <= block < self.num_blocks else "out of range"
                raise BlockAccountingError(f"free({rid!r}): block {block} is not its own (owner: {owner})")
        for block in table:
            self._owner[block] = None
            self._free.append(block)
        # A new list, not clear(): a caller that copied the old table keeps a consistent snapshot.
        seq.block_table = []
        del self._held[rid]
        return held

    def check_invariants(self, holders: Iterable[Sequence] | None = None) -> None:
        """Raise BlockAccountingError unless every block is exactly one of free or owned.

        With holders (every sequence that may hold blocks), also check that their tables match the
        owners recorded here and that no block is held by anyone else (a leak).
        """
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise BlockAccountingError("a block appears twice in the free list")
        for block, owner in enumerate(self._owner):
            if (block in free_set) == (owner is not None):
                state = "free and owned" if owner is not None else "neither free nor owned"
                raise BlockAccountingError(f"block {block} is {state} (owner: {owner})")
        counts = Counter(owner for owner in self._owner if owner is not None)
        if dict(counts) != self._held:
            raise BlockAccountingError(f"owner counts {dict(counts)} != held counts {self._held}")
        if len(self._free) + sum(self._held.values()) != self.num_blocks:
            raise BlockAccountingError("free plus held blocks do not add up to num_blocks")
        if holders is None:
            return
        seen: set[str] = set()
        for seq in holders:
            if not seq.block_table:
                continue
            seen.add(seq.request_id)
            if any(self._owner[b] != seq.request_id for b in seq.block_table):
                raise BlockAccountingError(f"{seq.request_id!r}'s table holds blocks it does not own")
            if len(seq.block_table) != self._held.get(seq.request_id):
                raise BlockAccountingError(f"{seq.request_id!r}'s table length differs from its count")
        leaked = set(self._held) - seen
        if leaked:
            raise BlockAccountingError(f"blocks held by sequences the caller does not know: {sorted(leaked)}")
