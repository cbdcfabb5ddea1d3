"""The Phi-3 family: Llama's layer, stored fused (one qkv_proj, one gate_up_proj), partial RoPE allowed.

This module owns reading a Phi-3 config.json (a sliding window on every layer when `sliding_window`
is set; `partial_rotary_factor`; `longrope` scaling is refused by the shared RoPE parser, since it
switches every position's frequencies once a sequence passes `original_max_position_embeddings`,
which would change the KV of prefixes already cached) and its checkpoint's names, which are already
fused in our order (q, k, v; gate, up). It must not hold arithmetic nor read files.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from services.worker.model.config import ModelConfig, llama_shape, positive_int, rope_parameters, rotary_dim
from services.worker.model.decoder import DecoderLM
from services.worker.model.family import Family

if TYPE_CHECKING:
    from torch import Tensor

_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def config(raw: dict[str, Any]) -> ModelConfig:
    shape = llama_shape(raw, "Phi3ForCausalLM")
    windows: tuple[int | None, ...] = ()
    if raw.get("sliding_window") is not None:
        windows = (positive_int(raw, "sliding_window"),) * shape.num_hidden_layers
    return replace(
        shape,
        attention_bias=False,
        o_proj_bias=False,
        mlp_bias=False,
        layer_windows=windows,
        rotary_dim=rotary_dim(raw, rope_parameters(raw), shape.head_dim),
    )


def checkpoint_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        names += [f"model.layers.{i}.{part}.weight" for part in (*_NORMS, *_PROJECTIONS)]
    return names


def state_dict(hf: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    return {name.removeprefix("model."): tensor for name, tensor in hf.items()}


FAMILY = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    config=config,
    build=DecoderLM,
    checkpoint_names=checkpoint_names,
    state_dict=state_dict,
)
