"""Greedy parity of our model with transformers on the real SmolLM2-135M-Instruct.

Eight prompts of mixed lengths (chat-templated and plain) decode 32 tokens together, one batched
forward per step over the paged cache; transformers' `generate` runs each prompt alone. Equality is
the parity rule of tests/parity.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.worker.model.loader import load_model
from tests.parity import assert_greedy_parity, hf_greedy_reference, paged_greedy_generate

if TYPE_CHECKING:
    from pathlib import Path

NEW_TOKENS = 32
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "List three prime numbers.",
]
PLAIN_PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans landed on the Moon. The mission was called Apollo 11, and the astronauts"
    " who walked on the surface were",
]


@pytest.mark.real_model
def test_batched_greedy_matches_generate(real_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    prompts: list[list[int]] = []
    for text in CHAT_PROMPTS:
        chat = [{"role": "user", "content": text}]
        text_prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert isinstance(text_prompt, str)
        # The template already starts with its own special tokens; add none twice.
        prompts.append(tokenizer(text_prompt, add_special_tokens=False)["input_ids"])
    prompts += [tokenizer(text)["input_ids"] for text in PLAIN_PROMPTS]
    assert len({len(p) for p in prompts}) >= 6, "prompt lengths should differ"

    ours = load_model(real_model_dir).model
    got = paged_greedy_generate(ours, prompts, NEW_TOKENS, block_size=16)
    assert all(len(tokens) == NEW_TOKENS for tokens in got)

    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    compared = 0
    for index, prompt in enumerate(prompts):
        ref, logits = hf_greedy_reference(hf, prompt, NEW_TOKENS)
        assert_greedy_parity(got[index], ref, logits, context=f"prompt {index}: {tokenizer.decode(prompt)!r}")
        compared += len(ref)
    # EOS may end chat answers early, but most of the 256 tokens must have been compared.
    assert compared >= NEW_TOKENS * len(prompts) // 2
