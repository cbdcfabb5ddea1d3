"""The Qwen2 family (Qwen2, Qwen2.5, Qwen2.5-Coder): Llama's layer with q/k/v biases.

This module owns reading a Qwen2 config.json: biases on q/k/v and none on o_proj, and, where
`use_sliding_window` is set, windows on the layers from `max_window_layers` on (or as `layer_types`
lists them), which the attention honours. Qwen3 reads its windows the same way (`qwen_windows`).
It must not hold arithmetic nor read files.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from services.worker.model.checkpoint import llama_layout_names, llama_layout_state_dict
from services.worker.model.config import ModelConfig, llama_shape, positive_int, windows_from_layer_types
from services.worker.model.decoder import DecoderLM
from services.worker.model.family import Family


def qwen_windows(raw: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Per-layer windows of a Qwen config, as transformers derives them."""
    listed = windows_from_layer_types(raw, layers)
    if listed is not None:
        return listed
    if not raw.get("use_sliding_window", False) or raw.get("sliding_window") is None:
        return ()
    window = positive_int(raw, "sliding_window")
    first = int(raw.get("max_window_layers", layers))
    windows = tuple(window if i >= first else None for i in range(layers))
    return windows if any(w is not None for w in windows) else ()


def config(raw: dict[str, Any]) -> ModelConfig:
    shape = llama_shape(raw, "Qwen2ForCausalLM")
    return replace(
        shape,
        attention_bias=True,
        o_proj_bias=False,
        mlp_bias=False,
        layer_windows=qwen_windows(raw, shape.num_hidden_layers),
    )


FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    config=config,
    build=DecoderLM,
    checkpoint_names=llama_layout_names,
    state_dict=llama_layout_state_dict,
)
