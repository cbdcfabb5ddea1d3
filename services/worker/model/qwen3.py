"""The Qwen3 family (dense): Llama's layer with an RMSNorm over each head of q and of k before RoPE.

This module owns reading a Qwen3 config.json: q/k norms, an explicit `head_dim` (often not
hidden_size / heads), biases only where `attention_bias` says, and Qwen's sliding-window layers. The
q/k norms keep it off the native decode stack (its kernels per operator still run). It must not hold
arithmetic nor read files.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from services.worker.model.checkpoint import llama_layout_names, llama_layout_state_dict
from services.worker.model.config import ModelConfig, llama_shape
from services.worker.model.decoder import DecoderLM
from services.worker.model.family import Family
from services.worker.model.qwen2 import qwen_windows


def config(raw: dict[str, Any]) -> ModelConfig:
    shape = llama_shape(raw, "Qwen3ForCausalLM")
    return replace(
        shape, qk_norm=True, mlp_bias=False, layer_windows=qwen_windows(raw, shape.num_hidden_layers)
    )


FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    config=config,
    build=DecoderLM,
    checkpoint_names=llama_layout_names,
    state_dict=llama_layout_state_dict,
)
