"""Prefix caching does not change what the model says: greedy outputs with a warm cache equal
transformers' `generate` (the parity rule of tests/parity.py), on a tiny random model and on SmolLM2.

A first wave of prompts warms the cache; a second wave reuses their shared system prefix (and a
prompt that repeats a whole earlier prompt plus its answer), runs concurrently with a small token
budget so the uncached suffixes are chunked and mixed with decodes, and must be served from cache
(the hit counters say so) while matching the reference. Wrong K/V from a shared block would change
the logits and fail the comparison.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from strata.sampling import SamplingParams
from tests.parity import assert_greedy_parity, hf_greedy_reference

if TYPE_CHECKING:
    from pathlib import Path


def _check_warm_cache_against_hf(
    model_dir: Path, first: list[list[int]], second: list[list[int]], new_tokens: int, config: EngineConfig
) -> None:
    engine = LLMEngine.from_model_dir(model_dir, config)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(first, params)
    before = engine.stats().prefix_hit_blocks
    got = engine.generate(second, params)
    stats = engine.stats()
    assert stats.prefix_hit_blocks - before >= len(second), "the second wave was not served from the cache"
    # Idle with a warm cache: every block is free or evictable, and evictable counts as free.
    assert stats.num_evictable_blocks > 0
    assert stats.free_kv_tokens == stats.total_kv_tokens
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for index, prompt in enumerate(second):
        ref, logits = hf_greedy_reference(hf, prompt, new_tokens)
        assert_greedy_parity(got[index], ref, logits, context=f"prompt {index} ({len(prompt)} tokens)")


def test_tiny_model_warm_cache_matches_generate(tiny_llama_dir: Path) -> None:
    rng = random.Random(5)
    system = [rng.randrange(2, 384) for _ in range(45)]
    first = [system + [rng.randrange(2, 384) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    second = [system + [rng.randrange(2, 384) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    second.append(first[0] + [rng.randrange(2, 384) for _ in range(9)])
    config = EngineConfig(max_num_batched_tokens=32, max_num_seqs=8, num_blocks=128, block_size=8)
    _check_warm_cache_against_hf(tiny_llama_dir, first, second, 12, config)


@pytest.mark.real_model
def test_real_model_warm_cache_matches_generate(real_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    system = (
        "You are a careful assistant for a museum of natural history. Answer in one short sentence, "
        "name the gallery where the visitor can see what they ask about, and never invent exhibits."
    )

    def chat(question: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))

    first = [chat("Where are the dinosaurs?")]
    second = [chat("Where can I see meteorites?"), chat("Is there a whale skeleton?"), first[0]]
    config = EngineConfig(max_num_batched_tokens=48, max_num_seqs=4, num_blocks=256)
    _check_warm_cache_against_hf(real_model_dir, first, second, 8, config)
