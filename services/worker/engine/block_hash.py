"""The identity of a full KV block's contents: a hash chained from the previous block's.

A block's K/V depend on every token before it, the model and its weights, so its hash covers the
parent block's hash, its own token ids, and a root that names the model (its weights' fingerprint)
and the cache salt (the tenant: one tenant can never reach another's blocks, so it cannot probe
their prompts by timing). The hash is only a lookup key: prefix_cache.py confirms every hit by
comparing tokens, so a collision costs a miss, never wrong K/V. blake2b, not Python's hash(): the
same tokens hash the same in every process. This module must not hold state nor import torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHashFn = Callable[[int, Sequence[int]], int]
"""(parent hash, the block's token ids) -> the block's hash; tests stub it to force collisions."""

_DIGEST_BYTES = 8


def root_hash(model_fingerprint: str, salt: str) -> int:
    """The parent hash of a chain's first block: the model's identity and the cache salt."""
    digest = hashlib.blake2b(f"{model_fingerprint}\0{salt}".encode(), digest_size=_DIGEST_BYTES)
    return int.from_bytes(digest.digest(), "little")


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of one full block: its parent's hash and its token ids."""
    digest = hashlib.blake2b(parent.to_bytes(_DIGEST_BYTES, "little"), digest_size=_DIGEST_BYTES)
    digest.update(array("I", tokens).tobytes())
    return int.from_bytes(digest.digest(), "little")


def chain_hashes(
    parent: int,
    tokens: Sequence[int],
    block_size: int,
    known: list[int],
    upto_blocks: int,
    hash_fn: BlockHashFn = block_hash,
) -> list[int]:
    """Extend `known` (the hashes of tokens' first full blocks) to `upto_blocks` full blocks; return it.

    Tokens at a position never change within a sequence, so hashes already computed stay valid.
    """
    limit = min(upto_blocks, len(tokens) // block_size)
    for index in range(len(known), limit):
        previous = known[index - 1] if index else parent
        known.append(hash_fn(previous, tokens[index * block_size : (index + 1) * block_size]))
    return known
