"""Counter-based sampling noise, a pure function of (seed, output position, vocabulary index), and
the exact picks built on it: Gumbel-max over candidate lists, inverse CDF, and the two-stage
head/tail draw for rows that may draw any token.

A request's noise for the token at output position p is fixed by its seed and p alone, so it draws
the same token alone or in any batch, after preemption, and on any replica of the same device type.
Nothing here keeps state or touches a torch.Generator: each value is an integer hash of its
coordinates, evaluated for a whole [rows, columns] block in one set of tensor operations.

This module must not decide what a request may draw (penalties, temperature, top-k, top-p): the
sampler does, and hands over scaled logits with the excluded tokens marked or at -inf.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1
_MASK32 = 0xFFFFFFFF
_GOLDEN64 = 0x9E3779B97F4A7C15
# Columns no vocabulary reaches (this one and the one below it): the per-row coins of the draws.
COIN_COLUMN = _MASK32
# Both multipliers are below 2**31 so that a 32-bit value times either stays below 2**63: int64
# tensor arithmetic never overflows (signed overflow is undefined in the kernels torch compiles).
_MUL_A = 0x21F0AAAD
_MUL_B = 0x735A2D97
# 23 bits of each hash become a uniform: (k + 0.5) / 2**23 is exact in float32, never 0 or 1.
_UNIFORM_BITS = 23


def _mix64(z: int) -> int:
    """The splitmix64 finaliser on Python integers (exact, unbounded ints masked to 64 bits)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_key(seed: int, position: int) -> tuple[int, int]:
    """The two 32-bit halves of the 64-bit key of one draw: a splitmix64 stream seeded by `seed`."""
    key = _mix64((_mix64(seed & _MASK64) + (position + 1) * _GOLDEN64) & _MASK64)
    return key & _MASK32, key >> 32


def row_keys(seeds: list[int], positions: list[int], device: torch.device) -> Tensor:
    """Keys of many draws as an int64 tensor [R, 2] on `device`."""
    pairs = [row_key(s, p) for s, p in zip(seeds, positions, strict=True)]
    return torch.tensor(pairs, dtype=torch.int64, device=device).reshape(len(pairs), 2)


def _round(h: Tensor) -> Tensor:
    """One xorshift-multiply round of a 32-bit integer hash, in place on values in [0, 2**32).

    The values are non-negative, so torch's arithmetic right shift acts as a logical one.
    """
    h.bitwise_xor_(h >> 16).mul_(_MUL_A).bitwise_and_(_MASK32)
    h.bitwise_xor_(h >> 15).mul_(_MUL_B).bitwise_and_(_MASK32)
    return h.bitwise_xor_(h >> 15)


def hash32(keys: Tensor, columns: Tensor) -> Tensor:
    """32-bit hashes of (row key, column) as int64 in [0, 2**32): shape broadcast of [R, 1] and columns.

    `keys` is [R, 2] from row_keys; `columns` is [R, C] or [1, C] of non-negative ids below 2**32.
    Two rounds with the second key half between them, so rows whose first halves differ by a small
    offset do not see shifted copies of one another's noise.
    """
    h = torch.add(columns, keys[:, 0:1]).bitwise_and_(_MASK32)
    h = _round(h)
    h.bitwise_xor_(keys[:, 1:2])
    return _round(h)


def uniform(keys: Tensor, columns: Tensor) -> Tensor:
    """Uniform float32 values in the open interval (0, 1), one per (row, column)."""
    bits = hash32(keys, columns) >> (32 - _UNIFORM_BITS)
    return bits.to(torch.float32).add_(0.5).mul_(2.0**-_UNIFORM_BITS)


def gumbel(keys: Tensor, columns: Tensor) -> Tensor:
    """Standard Gumbel float32 noise, -log(-log(U)), one per (row, column); always finite."""
    return uniform(keys, columns).log_().neg_().log_().neg_()


def inverse_cdf_pick(x: Tensor, excluded: Tensor, shift: Tensor, coin: Tensor) -> Tensor:
    """Column per row drawn with probability proportional to exp(x - shift) over non-excluded entries.

    One cumsum in column order, so the pick depends on the values and the coin alone, not on how an
    earlier topk ordered ties. `shift` [R] (a row max or logsumexp) keeps exp finite; `coin` [R] is
    uniform in (0, 1). Returns int64 [R, 1].
    """
    cdf = (x - shift[:, None]).exp_().masked_fill_(excluded, 0.0).cumsum_(dim=-1)
    target = coin[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=x.shape[1] - 1)


def gumbel_pick(keys: Tensor, vals: Tensor, ids: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """Gumbel-max over candidate lists: (best perturbed score, its token id), each [R].

    `vals` are the candidates' scaled logits, `ids` their token ids (the noise columns), `allowed`
    marks the ones that may win. Exact sampling from softmax(vals) over the allowed entries, and
    independent of the order of the list. A row with nothing allowed scores -inf.
    """
    noisy = torch.where(allowed, vals + gumbel(keys, ids), float("-inf"))
    best, at = noisy.max(dim=-1)
    return best, ids.gather(1, at[:, None]).squeeze(1)


def coins(keys: Tensor) -> Tensor:
    """Two uniforms per row [R, 2], from columns no vocabulary reaches."""
    return uniform(keys, torch.tensor([[COIN_COLUMN, COIN_COLUMN - 1]], device=keys.device))


def head_tail_pick(x: Tensor, keys: Tensor, head_size: int) -> tuple[Tensor, Tensor, int]:
    """Exact draw from softmax(x) per row without hashing the whole vocabulary: (score, token, tails).

    The head is every token strictly above the head_size-th largest value (defined by values, so
    not by how topk orders ties). A first coin picks the head with probability equal to its mass,
    then Gumbel-max draws within it; otherwise (rare on real logits: a few percent of draws) a
    second coin draws from the tail by inverse CDF, one cumsum instead of a hash per token. `score`
    is the winner's perturbed or raw logit, -inf only for a row with nothing finite; `tails` counts
    the rows that went to the tail.
    """
    r, vocab = x.shape
    size = min(head_size, vocab)
    vals, ids = x.topk(size, dim=-1)
    edge = vals[:, -1] if size < vocab else torch.full((r,), float("-inf"), device=x.device)
    in_head = vals > edge[:, None]
    lse = torch.logsumexp(x, dim=-1)
    mass = torch.where(in_head, (vals - lse[:, None]).exp(), 0.0).sum(dim=-1)
    coin = coins(keys)
    score, token = gumbel_pick(keys, vals, ids, in_head)
    tail = ((coin[:, 0] >= mass) & (edge > float("-inf"))).nonzero().squeeze(1)
    if tail.numel():
        xt = x[tail]
        picked = inverse_cdf_pick(xt, xt > edge[tail, None], lse[tail], coin[tail, 1])
        token[tail] = picked.squeeze(1)
        # -inf only if rounding pushed the target past every tail token; the caller falls back.
        score[tail] = xt.gather(1, picked).squeeze(1)
    return score, token, int(tail.numel())
