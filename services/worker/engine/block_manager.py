"""Paged KV cache bookkeeping: which fixed-size block each sequence's table holds, and which are free.

The block count is fixed at start; the tensors themselves live in the model runner, which reads each
sequence's block_table. This module is the one owner of blocks: it takes them (from the free list,
or by evicting a cached block nobody uses) and gives them back, counting each block's references
(a full block may sit in several tables when sequences share a prefix). It checks the accounting
exactly: freeing twice or a count that does not add up raises. It must not import torch nor do I/O.

With prefix caching (on by default), a full block a step has computed is offered to the index
(prefix_cache.py) as soon as that step ends; when its last reference goes, a cached block is
evictable rather than free: it keeps its K/V for the next sequence with that prefix and is evicted,
least recently used first, only when no free block is left. Evictable blocks count as free in
every figure this module reports. Tables are freed last block first, so a chain's tail is evicted
before its head, which more sequences share.

The free list is LIFO: the block freed last is handed out first. Its memory was touched most
recently, so it is the likeliest to still be warm in CPU caches and resident pages.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.worker.engine.block_hash import block_hash, chain_hashes, root_hash
from services.worker.engine.prefix_cache import CacheIndexError, PrefixIndex

if TYPE_CHECKING:
    from collections.abc import Iterable

    from services.worker.engine.block_hash import BlockHashFn
    from services.worker.engine.sequence import Sequence


class BlockAccountingError(RuntimeError):
    """A programming error: a double free, a foreign block, or counts that do not add up."""


class NoFreeBlocksError(RuntimeError):
    """allocate_for was asked for more blocks than are free; callers check can_grow first."""


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached blocks a waiting sequence would start from, before it takes them."""

    blocks: list[int]
    num_evictable: int
    """How many of them nobody references now: taking them leaves that many fewer to allocate."""


NO_HIT = PrefixHit([], 0)


class BlockManager:
    """Hands out KV cache blocks to sequences, shares cached ones, and takes them back."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = False,
        model_fingerprint: str = "",
        hash_fn: BlockHashFn = block_hash,
    ) -> None:
        """model_fingerprint: what else changes K/V (the model and its weights); in every root hash."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: the KV cache needs at least one block")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._fingerprint = model_fingerprint
        self._hash_fn = hash_fn
        # Reversed so that pop() hands out block 0 first: tables read naturally in logs and tests.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._holders: list[set[str]] = [set() for _ in range(num_blocks)]
        """Who references each block (its reference count is the set's size): a sequence freeing a
        block it never took is caught, even when others share that block."""
        self._held: dict[str, int] = {}
        self._roots: dict[str, int] = {}
        self.index = PrefixIndex()

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new sequence could get: free ones plus cached ones nobody references."""
        return len(self._free) + self.index.num_evictable

    @property
    def num_evictable_blocks(self) -> int:
        return self.index.num_evictable

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache's index, referenced or not."""
        return self.index.num_cached

    @property
    def num_evictions(self) -> int:
        return self.index.num_evictions

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def free_tokens(self) -> int:
        """The credits this worker publishes: tokens that fit in the free and evictable blocks."""
        return self.num_free_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a sequence, for the KV cache usage gauge."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a sequence holding no blocks could cache num_tokens now."""
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def blocks_to_grow(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq must gain so that its table covers num_tokens tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_to_grow(seq, num_tokens) <= self.num_free_blocks

    def capacity_for(self, seq: Sequence) -> int:
        """Most tokens seq could cover now: its own blocks plus every free or evictable one."""
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size

    def holds(self, seq: Sequence) -> bool:
        return seq.request_id in self._held

    def cached_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of seq (holding no blocks) in full blocks, taking nothing yet.

        It stops one token short of the whole sequence: the last token is always computed, so that
        its logits exist to sample from (and a shared block is never written).
        """
        if not self.enable_prefix_caching or seq.block_table:
            return NO_HIT
        usable = (seq.num_tokens - 1) // self.block_size
        if usable == 0:
            return NO_HIT
        tokens = seq.all_token_ids
        hashes = chain_hashes(
            self._root(seq.cache_salt), tokens, self.block_size, seq.block_hashes, usable, self._hash_fn
        )
        bs = self.block_size
        blocks = self.index.lookup(hashes[:usable], lambda i: tokens[i * bs : (i + 1) * bs], seq.cache_salt)
        return PrefixHit(blocks, sum(1 for b in blocks if not self._holders[b]))

    def can_admit(self, seq: Sequence, hit: PrefixHit, num_tokens: int) -> bool:
        """Whether seq could start from `hit` and cover num_tokens tokens now."""
        need = self.blocks_needed(num_tokens) - len(hit.blocks)
        return need <= self.num_free_blocks - hit.num_evictable

    def take_cached(self, seq: Sequence, hit: PrefixHit) -> int:
        """Start seq's table with the blocks of `hit` (from cached_prefix, nothing taken since); return
        the tokens they hold, which seq then has computed."""
        if seq.block_table or self.holds(seq):
            raise BlockAccountingError(f"take_cached({seq.request_id!r}): it already holds blocks")
        if not hit.blocks:
            return 0
        for block in hit.blocks:
            if not self.index.is_cached(block):
                raise BlockAccountingError(f"take_cached({seq.request_id!r}): block {block} is not cached")
            self._holders[block].add(seq.request_id)
            self.index.reuse(block)
        seq.block_table = list(hit.blocks)
        seq.num_committed_blocks = len(hit.blocks)
        self._held[seq.request_id] = len(hit.blocks)
        return len(hit.blocks) * self.block_size

    def allocate_for(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Grow seq's table to cover num_tokens tokens; return the blocks added (maybe none).

        New blocks come from the free list, then by evicting the least recently used cached block.
        """
        rid = seq.request_id
        if self._held.get(rid, 0) != len(seq.block_table):
            raise BlockAccountingError(
                f"sequence {rid!r} has {len(seq.block_table)} blocks in its table but the manager "
                f"gave it {self._held.get(rid, 0)}"
            )
        need = self.blocks_to_grow(seq, num_tokens)
        if need == 0:
            return []
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {rid!r} needs {need} more blocks for {num_tokens} tokens; "
                f"{self.num_free_blocks} free"
            )
        new = [self._free.pop() if self._free else self.index.evict() for _ in range(need)]
        for block in new:
            self._holders[block] = {rid}
        seq.block_table.extend(new)
        self._held[rid] = self._held.get(rid, 0) + need
        return new

    def release_tail(self, seq: Sequence, num_tokens: int) -> int:
        """Give back the blocks of seq's table past those that num_tokens tokens fill (a speculative
        step's rejected drafts' slots); return how many. Such a tail is seq's alone and uncached."""
        rid = seq.request_id
        keep = self.blocks_needed(num_tokens)
        tail = seq.block_table[keep:]
        if not tail:
            return 0
        for block in tail:
            if self._holders[block] != {rid} or self.index.is_cached(block):
                raise BlockAccountingError(
                    f"release_tail({rid!r}, {num_tokens}): block {block} is shared or cached "
                    f"(holders {sorted(self._holders[block])})"
                )
        # Last block first, so the next allocate_for hands the earliest of them out first.
        for block in reversed(tail):
            self._holders[block] = set()
            self._free.append(block)
        seq.block_table = seq.block_table[:keep]
        self._held[rid] -= len(tail)
        return len(tail)

    def commit(self, seq: Sequence) -> None:
        """Offer seq's full computed blocks to the prefix cache: call when a step that filled them ended."""
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, seq.block_table
        full = min(seq.num_computed_tokens // bs, len(table))
        if full <= seq.num_committed_blocks:
            return
        tokens = seq.all_token_ids
        hashes = chain_hashes(self._root(seq.cache_salt), tokens, bs, seq.block_hashes, full, self._hash_fn)
        for index in range(seq.num_committed_blocks, full):
            block = table[index]
            if not self.index.is_cached(block):
                parent = table[index - 1] if index else None
                content = tokens[index * bs : (index + 1) * bs]
                self.index.insert(block, hashes[index], content, seq.cache_salt, parent)
        seq.num_committed_blocks = full

    def free(self, seq: Sequence) -> int:
        """Drop seq's references to its blocks; return how many. Raises on any inconsistency."""
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
            if not 0 <= block < self.num_blocks or rid not in self._holders[block]:
                owners = sorted(self._holders[block]) if 0 <= block < self.num_blocks else "out of range"
                raise BlockAccountingError(f"free({rid!r}): block {block} is not its own (holders: {owners})")
        for block in table:
            self._holders[block].discard(rid)
            if not self._holders[block] and not self.index.is_cached(block):
                self._free.append(block)
        # Tail first, so the LRU evicts a chain's tail before the head that more sequences share.
        for block in reversed(table):
            if not self._holders[block] and self.index.is_cached(block):
                self.index.release(block)
        # A new list, not clear(): a caller that copied the old table keeps a consistent snapshot.
        seq.block_table = []
        seq.num_committed_blocks = 0
        del self._held[rid]
        return held

    def _root(self, salt: str) -> int:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = root_hash(self._fingerprint, salt)
        return root

    def check_invariants(self, holders: Iterable[Sequence] | None = None) -> None:
        """Raise BlockAccountingError unless every block is exactly one of free, evictable or referenced.

        With holders (every sequence that may hold blocks), also check that each block's reference
        count is the number of their tables that hold it, and that nobody else holds any (a leak).
        """
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise BlockAccountingError("a block appears twice in the free list")
        refs_of = [len(holders) for holders in self._holders]
        for block, refs in enumerate(refs_of):
            free, cached = block in free_set, self.index.is_cached(block)
            if (free and (refs or cached)) or (not free and not refs and not cached):
                raise BlockAccountingError(
                    f"block {block} has {refs} references, free={free}, cached={cached}: it must be exactly "
                    "one of free, evictable (cached, unreferenced) or referenced"
                )
        try:
            self.index.check_invariants(refs_of)
        except CacheIndexError as exc:
            raise BlockAccountingError(str(exc)) from exc
        referenced = sum(1 for refs in refs_of if refs)
        if len(self._free) + self.index.num_evictable + referenced != self.num_blocks:
            raise BlockAccountingError("free, evictable and referenced blocks do not add up to num_blocks")
        if holders is None:
            return
        counts: Counter[int] = Counter()
        seen: set[str] = set()
        for seq in holders:
            if not seq.block_table:
                continue
            seen.add(seq.request_id)
            counts.update(seq.block_table)
            if any(seq.request_id not in self._holders[b] for b in seq.block_table):
                raise BlockAccountingError(f"{seq.request_id!r}'s table holds blocks it does not own")
            if len(seq.block_table) != self._held.get(seq.request_id):
                raise BlockAccountingError(f"{seq.request_id!r}'s table length differs from its count")
        leaked = set(self._held) - seen
        if leaked:
            raise BlockAccountingError(f"blocks held by sequences the caller does not know: {sorted(leaked)}")
        for block, refs in enumerate(refs_of):
            if counts[block] != refs:
                raise BlockAccountingError(f"block {block} has {refs} references but {counts[block]} holders")
