"""The prefix cache's index: which full KV blocks hold which content, and which of them may be evicted.

A cached block is keyed by its chained hash (block_hash.py) and remembers its exact content: its
token ids, the cache salt, and the cache id of its parent block (0 for a chain's first block). A
lookup walks a sequence's block hashes and confirms every hit against that content, so a hash
collision is a miss, never wrong K/V: by induction each confirmed block holds exactly the tokens
before it. Cache ids are never reused, so a child of an evicted parent can never be confirmed
under a new block that took the parent's place.
Blocks nobody references stay cached in an LRU list and are evicted, oldest first, only when the
block manager needs a new block. This module only indexes: it must not take or give back blocks
(block_manager.py owns them and their reference counts) nor import torch.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


class CacheIndexError(RuntimeError):
    """A programming error in the index: a block indexed twice, or evicting one that is in use."""


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """What a cached block holds, exactly enough to confirm a hash hit."""

    block: int
    hash: int
    tokens: tuple[int, ...]
    salt: str
    parent_uid: int
    """The cache id of the previous block of its chain; 0 for a chain's first block."""
    uid: int
    """This entry's cache id, unique for the life of the process."""


class PrefixIndex:
    """Hash to cached block, with the content that confirms a hit, and the LRU of evictable blocks."""

    def __init__(self) -> None:
        self._by_hash: dict[int, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no sequence references, least recently used first."""
        self._uids = itertools.count(1)
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        return len(self._by_block)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._by_block

    def lookup(
        self, hashes: Sequence[int], tokens_of: Callable[[int], Sequence[int]], salt: str
    ) -> list[int]:
        """The blocks of the longest confirmed prefix: hashes[i] is block i's hash, tokens_of(i) its ids."""
        found: list[int] = []
        parent_uid = 0
        for index, key in enumerate(hashes):
            entry = self._by_hash.get(key)
            if (
                entry is None
                or entry.parent_uid != parent_uid
                or entry.salt != salt
                or entry.tokens != tuple(tokens_of(index))
            ):
                break
            found.append(entry.block)
            parent_uid = entry.uid
        return found

    def insert(self, block: int, key: int, tokens: Sequence[int], salt: str, parent: int | None) -> bool:
        """Index a just-filled block whose previous block in its table is `parent` (None: first).

        False, leaving it a private block, when its parent is not indexed (the chain is broken) or its
        hash is taken (the same content computed twice at once, or a collision: the first one stays).
        """
        if block in self._by_block:
            raise CacheIndexError(f"block {block} is indexed already")
        if key in self._by_hash:
            return False
        if parent is None:
            parent_uid = 0
        else:
            parent_entry = self._by_block.get(parent)
            if parent_entry is None:
                return False
            parent_uid = parent_entry.uid
        entry = CachedBlock(block, key, tuple(tokens), salt, parent_uid, next(self._uids))
        self._by_hash[key] = entry
        self._by_block[block] = entry
        return True

    def release(self, block: int) -> None:
        """A cached block's last reference was dropped: it becomes the most recently used evictable."""
        if block not in self._by_block:
            raise CacheIndexError(f"block {block} is not cached: it belongs on the free list")
        self._evictable[block] = None

    def reuse(self, block: int) -> None:
        """A cached block is referenced again: it is no longer evictable (if it was)."""
        self._evictable.pop(block, None)

    def evict(self) -> int:
        """Forget the least recently used evictable block and return it for reuse."""
        if not self._evictable:
            raise CacheIndexError("no cached block is evictable")
        block, _ = self._evictable.popitem(last=False)
        entry = self._by_block.pop(block)
        del self._by_hash[entry.hash]
        self.num_evictions += 1
        return block

    def check_invariants(self, refs: Sequence[int]) -> None:
        """Raise unless the two maps agree and the evictable blocks are exactly the cached unreferenced."""
        if len(self._by_hash) != len(self._by_block):
            raise CacheIndexError("the hash and block maps differ in size")
        for block, entry in self._by_block.items():
            if entry.block != block or self._by_hash.get(entry.hash) is not entry:
                raise CacheIndexError(f"block {block}'s entry is not indexed under its own hash")
            if (refs[block] == 0) != (block in self._evictable):
                state = "evictable" if block in self._evictable else "not evictable"
                raise CacheIndexError(f"cached block {block} has {refs[block]} references and is {state}")
        stray = [block for block in self._evictable if block not in self._by_block]
        if stray:
            raise CacheIndexError(f"evictable blocks {stray} are not cached")
