"""The engine's greedy output equals transformers' `generate` run one request at a time.

16 prompts of mixed lengths run concurrently through continuous batching (with a small token budget,
so long prompts are chunked and prefills mix with decodes), on a tiny random model and on the real
SmolLM2. Equality is the parity rule of tests/parity.py.
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


def _check_engine_against_hf(
    model_dir: Path, prompts: list[list[int]], new_tokens: int, config: EngineConfig
) -> None:
    engine = LLMEngine.from_model_dir(model_dir, config)
    got = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    # Steps that filled the token budget show the long prompts were chunked across steps.
    assert any(tokens >= config.max_num_batched_tokens - 1 for tokens, _ in engine.step_log)
    assert engine.stats().free_kv_tokens == engine.stats().total_kv_tokens
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for index, prompt in enumerate(prompts):
        ref, logits = hf_greedy_reference(hf, prompt, new_tokens)
        assert_greedy_parity(got[index], ref, logits, context=f"prompt {index} ({len(prompt)} tokens)")


def test_tiny_model_16_concurrent_prompts_match_generate(tiny_llama_dir: Path) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 384) for _ in range(rng.randint(1, 120))] for _ in range(16)]
    config = EngineConfig(max_num_batched_tokens=96, max_num_seqs=16, num_blocks=256, block_size=8)
    _check_engine_against_hf(tiny_llama_dir, prompts, 24, config)


@pytest.mark.real_model
def test_real_model_16_concurrent_prompts_match_generate(real_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    questions = [
        "What is the capital of France?",
        "Name a primary colour.",
        "Write one sentence about autumn leaves falling in a quiet park at dusk.",
        "How many legs does a spider have?",
        "Translate 'good morning' into Spanish.",
        "Give me a synonym for happy.",
        "What is two plus two?",
        "Describe the water cycle in three short steps, naming evaporation and condensation.",
    ]
    plain = [
        "Once upon a time, in a small village by the sea,",
        "The three laws of motion were described by",
        "import numpy as np\n\ndef mean(values):\n",
        "Dear team, thank you for",
        "Photosynthesis is the process by which green plants",
        "The recipe calls for two cups of flour, one egg, and",
        "In computer science, a hash table is",
        "Monday, Tuesday, Wednesday,",
    ]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in questions
    ] + [tokenizer.encode(p) for p in plain]
    # A fixed 512 MiB cache: sized from memory, this in-process engine would take most of a shared
    # test machine's free memory for 16 short prompts.
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=16, kv_cache_memory_bytes=512 * 2**20)
    _check_engine_against_hf(real_model_dir, prompts, 32, config)
