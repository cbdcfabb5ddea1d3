"""Log probabilities of sampled and prompt tokens, for the rows that ask for them and no others.

Computed as vLLM does by default: log_softmax in float32 of the model's raw logits, before any
processor (penalties, logit_bias, temperature, top-k/top-p/min_p), so they describe the model, not
the sampling transform. Each row gets its token's logprob and rank and its N most likely
alternatives (N <= 20). A row's values depend on its own logits alone, so they are batch-invariant.
This module must not sample, nor decide which tokens a row holds (the scheduler does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.worker.engine.sequence import TokenLogprobs

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import Tensor


def token_logprobs(
    logits: Tensor, tokens: Sequence[int], tops: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Per row of `logits` [N, V]: the logprobs of tokens[i] with tops[i] alternatives; None when
    tops[i] is None (the row did not ask, and costs nothing)."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    rows = [i for i, top in enumerate(tops) if top is not None]
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    block = logits if len(rows) == logits.shape[0] else logits[index]
    chosen = torch.tensor([tokens[i] for i in rows], device=logits.device)
    wanted = [int(tops[i] or 0) for i in rows]
    for i, entry in zip(rows, _of_rows(block, chosen, wanted), strict=True):
        out[i] = entry
    return out


def prompt_logprobs(logits: Tensor, next_ids: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Per row of `logits` [P, V] (position p of the prompt): the logprobs of next_ids[p], the prompt's
    token at p + 1, with `top` alternatives."""
    if not next_ids:
        return []
    chosen = torch.tensor(list(next_ids), device=logits.device)
    return _of_rows(logits, chosen, [top] * len(next_ids))


def _of_rows(block: Tensor, chosen: Tensor, tops: list[int]) -> list[TokenLogprobs]:
    x = block.to(torch.float32)
    # log_softmax without writing it out: logprob = logit - logsumexp, and top-k and rank read the
    # logits themselves (the same order). One logsumexp and one topk pass over the rows.
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen_x = x.gather(1, chosen[:, None])
    k = min(max(*tops, 1), x.shape[1])
    top_x, top_ids = x.topk(k, dim=-1)
    # Rank as vLLM counts it: 1 + the tokens strictly more likely. A token at the row's maximum (every
    # greedy one) is rank 1 without another pass; only the others count.
    ranks = torch.ones(x.shape[0], dtype=torch.int64, device=x.device)
    below = (chosen_x[:, 0] < top_x[:, 0]).nonzero().squeeze(1)
    if below.numel():
        ranks[below] = (x[below] > chosen_x[below]).sum(dim=-1) + 1
    chosen_lp = (chosen_x - lse).squeeze(1).tolist()
    top_lps = (top_x - lse).tolist()
    ids = top_ids.tolist()
    return [
        TokenLogprobs(
            token_id=int(token),
            logprob=float(value),
            rank=int(rank),
            top=tuple(zip(ids[j][: tops[j]], top_lps[j][: tops[j]], strict=True)),
        )
        for j, (token, value, rank) in enumerate(zip(chosen.tolist(), chosen_lp, ranks.tolist(), strict=True))
    ]
