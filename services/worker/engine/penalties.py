"""History-based logit processors: repetition penalty and no-repeat-ngram bans, batched and in place.

Both follow transformers' rules exactly, so a request sees the logits transformers would give it:
the CTRL repetition penalty (a token already in the history has a positive logit divided by the
penalty and a negative one multiplied, once however often it occurs) and the no-repeat-ngram ban
(a token that would complete an n-gram already in the history gets -inf). The history is the prompt
followed by the output so far.

This module must not scale by temperature, filter by top-k/top-p or draw tokens (sampler.py does),
and it never loops over the vocabulary: Python touches only the history ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import Tensor


def apply_penalties(
    x: Tensor,
    histories: Sequence[Sequence[int]],
    penalties: Sequence[float],
    ngram_sizes: Sequence[int],
    source: Tensor | None = None,
    divisor: Tensor | None = None,
) -> None:
    """Apply both processors to `x` [R, V] in place; the three sequences hold one entry per row.

    With `source` and `divisor` ([R]), `x` is taken to be source / divisor row-wise (the temperature
    already applied): a penalised entry becomes penalty(source) / divisor, exactly what penalising
    first and scaling after gives, without a second pass over the rows. A row with penalty 1.0 and
    ngram size 0 is left untouched. Ids outside [0, V) in a history are ignored, as transformers
    does for ids the output layer cannot produce.
    """
    penalised = [i for i, p in enumerate(penalties) if p != 1.0]
    if penalised:
        _repetition_penalty(x, penalised, histories, penalties, x if source is None else source, divisor)
    for n in sorted({n for n in ngram_sizes if n > 0}):
        rows = [i for i, size in enumerate(ngram_sizes) if size == n and len(histories[i]) >= n]
        if rows:
            _ban_repeated_ngrams(x, rows, histories, n)


def _flat_history(rows: list[int], histories: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    ids = [np.asarray(histories[i], dtype=np.int64).reshape(-1) for i in rows]
    owners = [np.full(len(h), row, dtype=np.int64) for row, h in zip(rows, ids, strict=True)]
    return np.concatenate(owners), np.concatenate(ids)


def _repetition_penalty(
    x: Tensor,
    rows: list[int],
    histories: Sequence[Sequence[int]],
    penalties: Sequence[float],
    source: Tensor,
    divisor: Tensor | None,
) -> None:
    owners, ids = _flat_history(rows, histories)
    valid = (ids >= 0) & (ids < x.shape[1])
    r = torch.from_numpy(owners[valid]).to(x.device)
    c = torch.from_numpy(ids[valid]).to(x.device)
    factor = torch.tensor(penalties, dtype=x.dtype, device=x.device)[r]
    scores = source[r, c]
    # Every occurrence of a token reads the original logit, so repeats write the same value: the
    # penalty lands once per token, as in transformers' gather-then-scatter.
    penalised = torch.where(scores < 0, scores * factor, scores / factor)
    if divisor is not None:
        penalised = penalised / divisor[r]
    x.index_put_((r, c), penalised)


def _ban_repeated_ngrams(x: Tensor, rows: list[int], histories: Sequence[Sequence[int]], n: int) -> None:
    lengths = np.array([len(histories[i]) for i in rows], dtype=np.int64)
    padded = np.full((len(rows), int(lengths.max())), -1, dtype=np.int64)
    for j, i in enumerate(rows):
        padded[j, : lengths[j]] = np.asarray(histories[i], dtype=np.int64).reshape(-1)
    hist = torch.from_numpy(padded).to(x.device)
    lens = torch.from_numpy(lengths).to(x.device)
    windows = hist.unfold(1, n, 1)
    # The last n-1 ids of each row: any earlier window that starts with them bans its last id.
    prefix_at = lens[:, None] - (n - 1) + torch.arange(n - 1, device=x.device)
    prefix = hist.gather(1, prefix_at)
    matches = (windows[..., : n - 1] == prefix[:, None, :]).all(dim=-1)
    # Only windows lying wholly inside the history count; later ones hold padding.
    starts = torch.arange(windows.shape[1], device=x.device)
    matches &= starts[None, :] <= (lens[:, None] - n)
    which, start = matches.nonzero(as_tuple=True)
    banned = windows[which, start, n - 1]
    keep = (banned >= 0) & (banned < x.shape[1])
    owners = torch.tensor(rows, dtype=torch.int64, device=x.device)[which[keep]]
    x.index_put_((owners, banned[keep]), torch.tensor(float("-inf"), dtype=x.dtype, device=x.device))
