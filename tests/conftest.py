"""Shared fixtures: tiny random-weight Llama-family models saved as safetensors, and the real model.

Tiny models are built from a transformers config with a fixed seed in well under a second each and
saved once per test session with `save_pretrained`, so every test loads them the way production
loads a checkpoint. The real SmolLM2 directory comes from `strata.cli.model_fetch`, which downloads it
on first use (`make model` does the same ahead of time). The `figure` fixture, with which a test
records a measured figure for the reliability report, comes from tests/figures.py (a plugin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytest_plugins = ("tests.figures",)

TINY_COMMON: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    # No EOS: random weights would stop generate() at arbitrary points and shorten the comparison.
    "eos_token_id": None,
    "pad_token_id": 0,
}


TINY_KINDS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
"""A tiny model's kind -> its transformers config and model classes."""


def build_tiny_model(directory: Path, kind: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a seeded random-weight model of `kind` (a key of TINY_KINDS) into `directory`."""
    import transformers

    if kind not in TINY_KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; known: {', '.join(TINY_KINDS)}")
    config_name, model_name = TINY_KINDS[kind]
    torch.manual_seed(seed)
    settings = {**TINY_COMMON, **overrides}
    model: Any = getattr(transformers, model_name)(getattr(transformers, config_name)(**settings))
    # Random init leaves norm weights at 1 and biases at 0; perturb them so a dropped or misplaced
    # norm weight or bias changes the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with tied embeddings and default RoPE."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama_untied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with untied embeddings, llama3 RoPE scaling and q/k/v/o and MLP biases."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-untied"),
        "llama",
        seed=1,
        tie_word_embeddings=False,
        rope_parameters=rope,
        attention_bias=True,
        mlp_bias=True,
    )


@pytest.fixture(scope="session")
def tiny_llama_linear_mqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with linear RoPE scaling and a single kv head (multi-query attention)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-linear"),
        "llama",
        seed=2,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2: Llama plus q/k/v biases (no o_proj bias)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=3, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3: q/k norms, a head_dim that is not hidden / heads, sliding windows on layers 1 and 2."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3"),
        "qwen3",
        seed=5,
        head_dim=32,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,
    )


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral with a 5-key sliding window on every layer, untied embeddings."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-mistral"),
        "mistral",
        seed=6,
        sliding_window=5,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 text: local (window 5, its own RoPE) and global layers (linear-scaled RoPE), q/k norms,
    sandwich norms, GeGLU, scaled embeddings, soft-capped logits (its attention's soft-cap setting,
    which transformers' Gemma 3 ignores, is set too, so a model that applied it would differ)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-gemma3"),
        "gemma3",
        seed=7,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        attn_logit_softcapping=8.0,
        final_logit_softcapping=4.0,
    )


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-3: fused qkv and gate_up in the checkpoint; half the head rotated; a 6-key window."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-phi3"),
        "phi3",
        seed=8,
        sliding_window=6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """models/SmolLM2-135M-Instruct, fetched on first use."""
    from strata.cli.model_fetch import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_serving_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama plus a tiny byte-level tokenizer with a chat template: a servable model folder."""
    from tests.tiny_tokenizer import write_tiny_tokenizer

    directory = build_tiny_model(
        tmp_path_factory.mktemp("tiny-serving"), "llama", seed=4, tie_word_embeddings=True
    )
    return write_tiny_tokenizer(directory)


def build_long_serving_dir(directory: Path, **tokenizer: Any) -> Path:
    """tiny_serving_dir's model (same seed) with a 4096-token context and the tiny tokenizer, written
    with `tokenizer`'s options (write_tiny_tokenizer's: another chat template, added tokens)."""
    from tests.tiny_tokenizer import write_tiny_tokenizer

    build_tiny_model(directory, "llama", seed=4, tie_word_embeddings=True, max_position_embeddings=4096)
    return write_tiny_tokenizer(directory, **tokenizer)


@pytest.fixture(scope="session")
def tiny_long_serving_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_serving_dir's model (same seed) and tokenizer with a 4096-token context, for requests that
    must run far longer than the 256 tokens the other tiny models allow."""
    return build_long_serving_dir(tmp_path_factory.mktemp("tiny-long-serving"))


@pytest.fixture(scope="session")
def tiny_fallback_dir(tiny_serving_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller tiny Llama (2 layers, other weights) with tiny_serving_dir's tokenizer files copied in,
    so both folders have the same tokenizer fingerprint: a primary and its fallback."""
    import shutil

    from strata.fingerprint import TOKENIZER_FILES

    directory = build_tiny_model(
        tmp_path_factory.mktemp("tiny-fallback"),
        "llama",
        seed=5,
        tie_word_embeddings=True,
        num_hidden_layers=2,
    )
    for name in TOKENIZER_FILES:
        if (tiny_serving_dir / name).is_file():
            shutil.copyfile(tiny_serving_dir / name, directory / name)
    return directory


@pytest.fixture
def gguf_float32_products() -> Iterator[None]:
    """The GGUF kernels with their 8-bit activations off for one test: a model served from a GGUF is
    then the float32 model of the dequantized file, which transformers and the float32 conversion run
    too, so greedy tokens and logits can be compared exactly."""
    from services.worker.model import gguf_linear, native

    kernels = native.library()
    if kernels is None:
        yield
        return
    previous = gguf_linear.set_integer_activations(kernels, False)
    try:
        yield
    finally:
        gguf_linear.set_integer_activations(kernels, previous)
