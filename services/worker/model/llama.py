"""The Llama family: Llama 1, 2 and 3.x (linear or llama3 RoPE scaling), and SmolLM2, TinyLlama.

This module owns reading a Llama checkpoint's config.json into a ModelConfig; the model is the shared
decoder with Llama's defaults and the checkpoint has Llama's layout. It must not hold arithmetic
(layers.py does) nor read files (the loader does).
"""

from __future__ import annotations

from typing import Any

from services.worker.model.checkpoint import llama_layout_names, llama_layout_state_dict
from services.worker.model.config import ModelConfig, ModelLoadError, llama_shape, rope_parameters, rotary_dim
from services.worker.model.decoder import DecoderLM
from services.worker.model.family import Family


def config(raw: dict[str, Any]) -> ModelConfig:
    shape = llama_shape(raw, "LlamaForCausalLM")
    if rotary_dim(raw, rope_parameters(raw), shape.head_dim):
        raise ModelLoadError(
            "partial_rotary_factor != 1 is not supported by Llama models: Llama rotates whole heads"
        )
    return shape


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    config=config,
    build=DecoderLM,
    checkpoint_names=llama_layout_names,
    state_dict=llama_layout_state_dict,
)
