"""The int8 KV cache's quality against the float32 one, through the engine's own model and kernels.

Perplexity: bench/perplexity.py's windows of the fixed text (the one `make bench-peer` uses), fed
one token a forward pass after the first, as decode steps, so every scored token's attention reads
its whole context from the cache in that cache's format (the native decode kernel on the CPU; a
window's first token alone attends to itself). Greedy agreement: the eight prompts of the
real-model parity test (bench/model_parity.py's prompt_ids), `new_tokens` greedy tokens each through
LLMEngine with each cache; per prompt, the tokens before the first divergence agree, and at a
divergence the float32 run's top-2 log-probability gap there says whether it was a near tie under
the parity rule (tests/parity.py's TIE_GAP: under 1e-3, and the int8 pick the runner-up). This module
measures; it must not time anything (bench/kv_cache.py does) nor judge the targets.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from bench.perplexity import BLOCK_SIZE, read_text, scored_nll, token_ids, windows

if TYPE_CHECKING:
    from pathlib import Path

TIE_GAP = 1e-3  # tests/parity.py's


def decode_logits(loaded: Any, window: list[int], cache_dtype: str) -> torch.Tensor:
    """Logits [len(window), vocab]: the window's first token as a prefill, then one decode step per
    token, over a cache of `cache_dtype`."""
    from services.worker.model import kv_format
    from services.worker.model.attention import AttentionMetadata
    from services.worker.model.kv_cache import KVCache

    fmt = kv_format.resolve(cache_dtype, loaded.dtype, "cpu")
    blocks = math.ceil(len(window) / BLOCK_SIZE)
    cache = KVCache.allocate(loaded.config, blocks, BLOCK_SIZE, fmt, "cpu")
    table = [list(range(blocks))]
    rows = []
    with torch.inference_mode():
        for position, token in enumerate(window):
            decodes = 1 if position else 0
            meta = AttentionMetadata.build([1], [position + 1], table, BLOCK_SIZE, "cpu", decodes)
            hidden = loaded.model(torch.tensor([token]), torch.tensor([position]), meta, cache)
            rows.append(loaded.model.compute_logits(hidden))
    return torch.cat(rows)


def perplexities(model_dir: Path, context: int, cache_dtypes: list[str]) -> dict[str, Any]:
    """Perplexity of the fixed text with each cache format, and how many tokens each scored."""
    from services.worker.model.loader import load_model

    loaded = load_model(model_dir)
    ids, bos = token_ids(model_dir, read_text())
    chunks = windows(ids, context, bos)
    found = {}
    for name in cache_dtypes:
        total, count = 0.0, 0
        for window in chunks:
            nll, scored = scored_nll(decode_logits(loaded, window, name), window)
            total, count = total + nll, count + scored
        found[name] = {"perplexity": math.exp(total / count), "scored_tokens": count}
    return found


def greedy_agreement(engines: dict[str, Any], prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """engines: {"float32": ..., "int8": ...}; the int8 cache's greedy tokens against float32's."""
    from strata.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logprobs=2)
    reference = run_greedy(engines["float32"], prompts, params)
    ours = run_greedy(engines["int8"], prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    return agreement(reference, [tokens for tokens, _ in ours], new_tokens)


def agreement(
    reference: list[tuple[list[int], list[Any]]], outputs: list[list[int]], new_tokens: int
) -> dict[str, Any]:
    """Each output against its reference run (tokens, and their top-2 log-probabilities): the tokens
    before the first divergence, and whether that divergence is a near tie under the parity rule."""
    per_prompt = []
    for (ref_tokens, ref_logprobs), got in zip(reference, outputs, strict=True):
        step = next((i for i, (a, b) in enumerate(zip(ref_tokens, got, strict=True)) if a != b), None)
        entry: dict[str, Any] = {"agreeing": new_tokens if step is None else step, "diverged_at": step}
        if step is not None:
            top = ref_logprobs[step].top
            gap = top[0][1] - top[1][1]
            entry.update(gap=gap, near_tie=gap < TIE_GAP and got[step] == top[1][0])
        per_prompt.append(entry)
    agreeing = sum(entry["agreeing"] for entry in per_prompt)
    return {
        "prompts": len(outputs),
        "new_tokens": new_tokens,
        "tokens_before_first_divergence": agreeing,
        "agreement": agreeing / (len(outputs) * new_tokens),
        "divergences": sum(1 for entry in per_prompt if entry["diverged_at"] is not None),
        "every_divergence_a_near_tie": all(entry.get("near_tie", True) for entry in per_prompt),
        "per_prompt": per_prompt,
    }


def run_greedy(engine: Any, prompts: list[list[int]], params: Any) -> list[tuple[list[int], list[Any]]]:
    """Each prompt's greedy tokens and, when params asks, their log probabilities."""
    ids = [f"quality-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    logprobs: dict[str, list[Any]] = {rid: [] for rid in ids}
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.validate(prompt, params)
        engine.add_request(rid, prompt, params)
    pending = set(ids)
    while pending:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(out.logprobs or [])
            if out.finished:
                pending.discard(out.request_id)
    return [(tokens[rid], logprobs[rid]) for rid in ids]
