"""The OpenAI/vLLM logit processors: logit_bias, presence and frequency penalties, min_tokens, min_p,
typical_p.

The sampler (sampler.py) applies every processor of a row in one fixed order, transformers' where it
has the processor and vLLM's for the penalties it lacks:

1. logit_bias: each listed token's logit plus its bias (transformers' SequenceBiasLogitsProcessor);
2. repetition penalty, then no-repeat-ngram (penalties.py);
3. presence and frequency penalties over the generated tokens only, as OpenAI and vLLM define them:
   logit - presence * (count > 0) - frequency * count;
4. min_tokens: while fewer tokens than min_tokens were generated, EOS (unless ignore_eos) and the
   request's stop token ids are banned (-inf), as transformers' MinNewTokensLengthLogitsProcessor;
5. temperature, top-k, top-p (sampler.py), then min_p: tokens whose probability is below min_p times
   the most likely token's are dropped (transformers' MinPLogitsWarper);
6. typical_p (locally typical sampling, transformers' TypicalLogitsWarper, after min_p as there):
   over what is left, tokens are taken in order of how near their surprisal -log p is to the
   distribution's entropy, until they hold typical_p of the probability; ties with the last one taken
   stay too.

Steps 1-4 act on raw logits before temperature. A failover's prior output counts as generated.
This module owns steps 1, 3, 4, min_p's threshold and typical_p's set; it must not draw tokens, scale
by temperature or read the prompt (only the output, which the row carries).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from torch import Tensor

    from strata.sampling import SamplingParams

_NEG_INF = float("-inf")


def banned_until_min_tokens(
    params: SamplingParams, generated: int, eos_token_ids: Iterable[int]
) -> tuple[int, ...]:
    """The ids min_tokens bans for a row that has generated `generated` tokens (none once reached)."""
    if generated >= params.min_tokens:
        return ()
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return tuple(sorted({*eos, *params.stop_token_ids}))


def apply_logit_bias(x: Tensor, params: Sequence[SamplingParams]) -> None:
    """Step 1, in place on raw logits [R, V]; ids outside the vocabulary were refused upstream."""
    rows: list[int] = []
    ids: list[int] = []
    bias: list[float] = []
    for i, p in enumerate(params):
        for token, value in p.logit_bias:
            rows.append(i)
            ids.append(token)
            bias.append(value)
    if rows:
        index = (torch.tensor(rows, device=x.device), torch.tensor(ids, device=x.device))
        x.index_put_(index, torch.tensor(bias, dtype=x.dtype, device=x.device), accumulate=True)


def apply_output_penalties(
    x: Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
    banned: Sequence[Sequence[int]],
    divisor: Tensor,
) -> None:
    """Steps 3 and 4, in place on `x` [R, V] that already holds logits / divisor (the temperature).

    outputs[i] is row i's generated ids (prior output included); banned[i] the ids min_tokens bans.
    """
    rows = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and outputs[i]]
    if rows:
        _presence_frequency(x, [params[i] for i in rows], [outputs[i] for i in rows], rows, divisor)
    cells = [(i, t) for i, ids in enumerate(banned) for t in ids if 0 <= t < x.shape[1]]
    if cells:
        r, t = zip(*cells, strict=True)
        x[torch.tensor(r, device=x.device), torch.tensor(t, device=x.device)] = _NEG_INF


def _presence_frequency(
    x: Tensor, params: list[SamplingParams], outputs: list[Sequence[int]], rows: list[int], divisor: Tensor
) -> None:
    vocab = x.shape[1]
    owners = np.concatenate([np.full(len(out), k, dtype=np.int64) for k, out in enumerate(outputs)])
    ids = np.concatenate([np.asarray(out, dtype=np.int64).reshape(-1) for out in outputs])
    keep = (ids >= 0) & (ids < vocab)
    # One [rows, V] count table from a flat index_add: Python touches only the output ids.
    counts = torch.zeros(len(rows), vocab, dtype=x.dtype, device=x.device)
    flat = torch.from_numpy(owners[keep] * vocab + ids[keep]).to(x.device)
    counts.view(-1).index_add_(0, flat, torch.ones(flat.numel(), dtype=x.dtype, device=x.device))
    presence = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=x.device)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=x.device)
    penalty = (counts > 0).to(x.dtype) * presence[:, None] + counts * frequency[:, None]
    index = torch.tensor(rows, device=x.device)
    x[index] -= penalty / divisor[index, None]


def min_p_threshold(best: Tensor, min_p: Tensor) -> Tensor:
    """The smallest scaled logit min_p keeps, per row: p >= min_p * p_max is x >= x_max + log(min_p).

    Rows with min_p 0 get -inf (nothing dropped).
    """
    log_min_p = torch.where(min_p > 0, min_p.clamp_min(1e-30).log(), torch.full_like(min_p, _NEG_INF))
    return best + log_min_p


def typical_keep(x: Tensor, mass: Tensor) -> Tensor:
    """Bool [R, V]: what typical_p keeps of scaled logits x [R, V] (-inf: already dropped), per row's
    mass [R]. A token's distance is |-log p - H| (H: the row's entropy); the kept set is every token
    no farther than the one at which the nearest-first running mass first reaches `mass`. Defined by
    values, so it does not depend on how a sort orders ties, nor on the batch.
    """
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).nansum(dim=-1, keepdim=True)
    distance = (logp.neg() - entropy).abs()
    nearest, order = distance.sort(dim=-1)
    # The running mass from a softmax taken in that order, as transformers takes it: the same bits at
    # the boundary, where summing p in another order can flip the last token in or out.
    running = x.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (running < mass[:, None]).sum(dim=-1).clamp_(max=x.shape[1] - 1)
    return (distance <= nearest.gather(1, last[:, None])) & (x > _NEG_INF)
