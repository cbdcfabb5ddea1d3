"""The parity rule between our model (or engine) and transformers, written once for every test.

"Equal" greedy output means identical tokens, or, at the first divergence, a near tie in the
reference: its top-2 logit gap is under `TIE_GAP` and our pick is its runner-up. Float rounding
legitimately flips such ties, and after a flip the continuations are different texts, so nothing
after the first divergence is compared.

EOS policy: `hf_greedy_reference` lets transformers stop at the model's EOS (as a client would
see), so a reference may be shorter than `max_new_tokens`; `assert_greedy_parity` compares the
reference's tokens only, and our run may go on past EOS (engines run with ignore_eos in parity
tests, so every prompt yields the same number of steps). Our run must be at least as long.

This module also holds `paged_greedy_generate`, a minimal greedy driver over our model that batches
every prompt into one forward per step, so model tests need no engine.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig

from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import Tensor

    from services.worker.model.family import CausalLM

TIE_GAP = 1e-3


def assert_greedy_parity(
    ours: Sequence[int], ref: Sequence[int], ref_logits: Sequence[Tensor], context: str = ""
) -> None:
    """Fail unless `ours` equals `ref` under the parity rule; ref_logits[i] are the reference's at step i."""
    where = f" [{context}]" if context else ""
    if len(ref_logits) < len(ref):
        raise ValueError(f"{len(ref_logits)} reference logits for {len(ref)} reference tokens{where}")
    for step, expected in enumerate(ref):
        if step >= len(ours):
            raise AssertionError(
                f"ours stopped after {len(ours)} tokens, the reference has {len(ref)}{where}: "
                f"ours={list(ours)} ref={list(ref)}"
            )
        got = int(ours[step])
        if got == int(expected):
            continue
        top = torch.topk(ref_logits[step].float().flatten(), 2)
        gap = float(top.values[0] - top.values[1])
        runner_up = int(top.indices[1])
        if gap < TIE_GAP and got == runner_up:
            return
        our_logit = float(ref_logits[step].float().flatten()[got])
        raise AssertionError(
            f"greedy divergence at step {step}{where}: ours={got} ref={int(expected)} "
            f"(reference top-2 gap {gap:.3g}, runner-up {runner_up}, reference logit of ours "
            f"{our_logit:.4f} vs top {float(top.values[0]):.4f})\n"
            f"ours={list(ours)}\nref ={list(ref)}"
        )


def hf_greedy_reference(
    hf_model: Any, prompt_ids: Sequence[int], max_new_tokens: int
) -> tuple[list[int], list[Tensor]]:
    """transformers' greedy `generate` on ONE prompt: (new tokens, raw float32 logits of each step).

    A fresh GenerationConfig keeps a checkpoint's sampling defaults (temperature, repetition
    penalty) out of the reference; generation stops at the model's EOS.
    """
    eos = hf_model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad if pad is not None else 0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logits = [step[0].float() for step in out.logits]
    return tokens, logits


def assert_logits_close(ours: Tensor, ref: Tensor, atol: float = 1e-4, context: str = "") -> None:
    """Fail unless two logit tensors of the same shape agree within `atol` everywhere."""
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != {tuple(ref.shape)} [{context}]"
    diff = float((ours.float() - ref.float()).abs().max())
    assert diff <= atol, f"max |logit difference| {diff:.3g} > {atol} [{context}]"


def paged_greedy_generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    block_size: int = 16,
    seed: int = 0,
    step_logits: list[Tensor] | None = None,
) -> list[list[int]]:
    """Greedy tokens for every prompt: one batched prefill forward, then one forward per decode step.

    Each sequence gets shuffled, non-contiguous block ids, so the paged layout is exercised. Each
    step's logits [len(prompts), vocab] are appended to `step_logits` when one is given.
    """
    config = model.config
    needed = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]
    pool = list(range(sum(needed) + 3))
    random.Random(seed).shuffle(pool)
    tables = []
    for count in needed:
        tables.append(pool[:count])
        pool = pool[count:]
    cache = KVCache.allocate(config, sum(needed) + 3, block_size, model.dtype, model.device)
    outputs: list[list[int]] = [[] for _ in prompts]
    lengths = [len(p) for p in prompts]
    with torch.inference_mode():
        for step in range(max_new_tokens):
            if step == 0:
                ids = [t for p in prompts for t in p]
                positions = [i for p in prompts for i in range(len(p))]
                query_lens = list(lengths)
            else:
                ids = [out[-1] for out in outputs]
                positions = [n - 1 for n in lengths]
                query_lens = [1] * len(prompts)
            meta = AttentionMetadata.build(
                query_lens=query_lens,
                context_lens=lengths,
                block_tables=tables,
                block_size=block_size,
                device=model.device,
                num_decodes=0 if step == 0 else len(prompts),
            )
            hidden = model(
                torch.tensor(ids, device=model.device),
                torch.tensor(positions, device=model.device),
                meta,
                cache,
            )
            logits = model.compute_logits(hidden.index_select(0, meta.last_token_indices))
            if step_logits is not None:
                step_logits.append(logits)
            for out, token in zip(outputs, logits.argmax(dim=-1).tolist(), strict=True):
                out.append(int(token))
            lengths = [n + 1 for n in lengths]
    return outputs


def prefill_logits(model: CausalLM, prompts: Sequence[Sequence[int]], block_size: int = 16) -> Tensor:
    """Our model's float32 logits at each prompt's last position [len(prompts), vocab], from one
    batched prefill forward over a fresh paged cache."""
    config = model.config
    needed = [-(-len(p) // block_size) for p in prompts]
    starts = [sum(needed[:i]) for i in range(len(prompts))]
    tables = [list(range(start, start + count)) for start, count in zip(starts, needed, strict=True)]
    cache = KVCache.allocate(config, sum(needed), block_size, model.dtype, model.device)
    lengths = [len(p) for p in prompts]
    meta = AttentionMetadata.build(
        query_lens=lengths,
        context_lens=lengths,
        block_tables=tables,
        block_size=block_size,
        device=model.device,
        num_decodes=0,
    )
    ids = torch.tensor([t for p in prompts for t in p], device=model.device)
    positions = torch.tensor([i for p in prompts for i in range(len(p))], device=model.device)
    with torch.inference_mode():
        hidden = model(ids, positions, meta, cache)
        return model.compute_logits(hidden.index_select(0, meta.last_token_indices))
