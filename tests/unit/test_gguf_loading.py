"""Serving a GGUF file as shipped, against transformers reading the same file.

The config comes from the file's metadata, tensors by their GGUF names, a Llama-arch file's q/k rows
are un-permuted, projections stay in their block types (a fused q/k/v of three types is one module
of three parts), a type without a kernel is dequantized at load with a warning naming it, and the
model's greedy output and logits match transformers' own GGUF loading (which dequantizes everything).
"""

from __future__ import annotations

import logging
import shutil
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
from torch import nn

from services.worker.model import decode_stack, native
from services.worker.model.config import ModelLoadError
from services.worker.model.gguf_linear import GgufEmbedding, GgufLinear
from services.worker.model.loader import load_model
from tests.conftest import build_tiny_model
from tests.gguf_blocks import T
from tests.gguf_files import write_gguf
from tests.native_calls import count_decode_stack_calls
from tests.parity import (
    assert_greedy_parity,
    assert_logits_close,
    hf_greedy_reference,
    paged_greedy_generate,
    prefill_logits,
)

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.model.layers import DecoderLayer

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")

# A Q4_K_M-like mix, one type per projection, and Q2_K, which has no kernel.
TYPES = {
    "q_proj": T.Q4_K,
    "k_proj": T.Q6_K,
    "v_proj": T.Q8_0,
    "o_proj": T.Q5_0,
    "gate_proj": T.Q4_1,
    "up_proj": T.Q5_K,
    "down_proj": T.Q2_K,
    "embed_tokens": T.Q8_0,
    "lm_head": T.Q6_K,
}
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = [[1, 17, 29, 301, 5], [1, 250, 4], [1, 9, 9, 9, 9, 9, 9, 120]]


def _qtype(name: str) -> T:
    return next((qtype for key, qtype in TYPES.items() if f".{key}." in f".{name}"), T.F32)


def _gguf_folder(tmp_path_factory: pytest.TempPathFactory, kind: str, **overrides: Any) -> Path:
    checkpoint = build_tiny_model(tmp_path_factory.mktemp(f"{kind}-hf"), kind, **{**SHAPE, **overrides})
    folder = tmp_path_factory.mktemp(f"{kind}-gguf")
    write_gguf(checkpoint, folder / "tiny.gguf", kind, _qtype)
    return folder


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _gguf_folder(tmp_path_factory, "llama", tie_word_embeddings=False)


def _transformers(folder: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model: nn.Module = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="tiny.gguf", dtype=torch.float32
    )
    return model.eval()


def _assert_matches_transformers(folder: Path) -> None:
    ours = load_model(folder)
    reference = _transformers(folder)
    generated = paged_greedy_generate(ours.model, PROMPTS, max_new_tokens=8)
    for prompt, tokens in zip(PROMPTS, generated, strict=True):
        expected, logits = hf_greedy_reference(reference, prompt, 8)
        assert_greedy_parity(tokens, expected, logits, context=str(prompt))
        with torch.inference_mode():
            ref_first = reference(torch.tensor([prompt])).logits[0, -1]
        scale = float(ref_first.abs().max())
        ours_first = prefill_logits(ours.model, [prompt])[0]
        assert_logits_close(ours_first, ref_first, atol=1e-4 * max(scale, 1.0), context=str(prompt))


@pytest.mark.usefixtures("gguf_float32_products")
def test_a_llama_gguf_matches_transformers_reading_the_same_file(llama_gguf: Path) -> None:
    _assert_matches_transformers(llama_gguf)


@pytest.mark.usefixtures("gguf_float32_products")
def test_a_qwen2_gguf_with_biases_and_tied_embeddings_matches_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _assert_matches_transformers(_gguf_folder(tmp_path_factory, "qwen2", tie_word_embeddings=True))


def test_projections_stay_in_their_types_and_one_without_a_kernel_is_dequantized(
    llama_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        loaded = load_model(llama_gguf)
    layer = cast("DecoderLayer", loaded.model.layers[0])
    formats = {
        name: module.format() if isinstance(module, GgufLinear) else type(module).__name__
        for name, module in (
            ("qkv", layer.self_attn.qkv_proj),
            ("o", layer.self_attn.o_proj),
            ("gate_up", layer.mlp.gate_up_proj),
            ("down", layer.mlp.down_proj),
            ("lm_head", loaded.model.lm_head),
        )
    }
    # Q2_K has no kernel: down_proj is a dense nn.Linear.
    assert formats == {
        "qkv": "Q4_K+Q6_K+Q8_0",
        "o": "Q5_0",
        "gate_up": "Q4_1+Q5_K",
        "down": "Linear",
        "lm_head": "Q6_K",
    }
    assert isinstance(loaded.model.embed_tokens, GgufEmbedding)
    assert "dequantized at load" in caplog.text and "Q2_K x3" in caplog.text


def test_the_native_decode_stack_runs_gguf_layers_with_the_per_operator_paths_bits(
    llama_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(llama_gguf).model
    calls = count_decode_stack_calls(monkeypatch)
    stacked: list[torch.Tensor] = []
    tokens = paged_greedy_generate(model, PROMPTS, max_new_tokens=6, step_logits=stacked)
    assert len(calls) == 5  # every decode step after the prefill
    previous = decode_stack.set_enabled(False)
    try:
        per_operator: list[torch.Tensor] = []
        assert paged_greedy_generate(model, PROMPTS, max_new_tokens=6, step_logits=per_operator) == tokens
    finally:
        decode_stack.set_enabled(previous)
    assert len(calls) == 5
    assert all(torch.equal(a, b) for a, b in zip(stacked, per_operator, strict=True))


def test_a_tied_model_projects_with_its_embedding_blocks(tmp_path_factory: pytest.TempPathFactory) -> None:
    loaded = load_model(_gguf_folder(tmp_path_factory, "llama", tie_word_embeddings=True))
    head, embeddings = loaded.model.lm_head, loaded.model.embed_tokens
    assert isinstance(head, GgufLinear) and isinstance(embeddings, GgufEmbedding)
    # One copy of the blocks: the projection's part is the embedding's tensor.
    assert head.stored_parts()[0][1].data_ptr() == embeddings.stored_parts()[0][1].data_ptr()


def test_bad_gguf_folders_are_refused_with_the_fix(llama_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="served in the types it stores"):
        load_model(llama_gguf, quantization="dynamic-int8")
    both = tmp_path / "both"
    shutil.copytree(llama_gguf, both)
    (both / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="one set of weights"):
        load_model(both)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "tiny.gguf").write_bytes((llama_gguf / "tiny.gguf").read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf"):
        load_model(truncated)
