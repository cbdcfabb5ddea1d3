"""The Mistral family: Llama's layer and layout with a sliding window on every layer when configured.

This module owns reading a Mistral config.json: `sliding_window` (null in Mistral 7B v0.2 and later,
4096 in v0.1) becomes every layer's window, which the attention honours. It must not hold arithmetic
nor read files.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from services.worker.model.checkpoint import llama_layout_names, llama_layout_state_dict
from services.worker.model.config import ModelConfig, ModelLoadError, llama_shape, positive_int
from services.worker.model.decoder import DecoderLM
from services.worker.model.family import Family


def config(raw: dict[str, Any]) -> ModelConfig:
    if "layer_types" in raw:
        raise ModelLoadError(
            "a Mistral config with layer_types alternates attention kinds, which Mistral models do not: "
            "drop layer_types, or serve the checkpoint under the architecture it was trained as"
        )
    shape = llama_shape(raw, "MistralForCausalLM")
    if raw.get("sliding_window") is None:
        return shape
    window = positive_int(raw, "sliding_window")
    return replace(shape, layer_windows=(window,) * shape.num_hidden_layers)


FAMILY = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    model_types=("mistral",),
    config=config,
    build=DecoderLM,
    checkpoint_names=llama_layout_names,
    state_dict=llama_layout_state_dict,
)
