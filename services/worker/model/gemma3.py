"""The Gemma 3 text family: q/k norms, norms on each block's output, GeGLU, scaled embeddings, and
alternating sliding-window (local) and global layers with a RoPE each.

This module owns reading a Gemma 3 config.json (either layout: 5.x's `layer_types` and per-type
`rope_parameters`, or 4.x's `sliding_window_pattern`, `rope_local_base_freq` and `rope_scaling`), and
its checkpoint: Gemma's RMSNorms scale by (1 + weight), so every norm weight is stored here as
1 + weight and the shared RMSNorm runs unchanged; its `post_attention_layernorm` norms the attention's
output and `pre_feedforward_layernorm` is our post-attention (pre-MLP) norm. The logits are
soft-capped by `final_logit_softcapping`; `attn_logit_softcapping` is read by no Gemma 3 layer (as in
transformers: it was Gemma 2's), so it is ignored. The multimodal
Gemma3ForConditionalGeneration is refused (its vision tower is not served). It must not hold
arithmetic nor read files.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from services.worker.model.checkpoint import llama_layout_names, llama_layout_state_dict
from services.worker.model.config import (
    ModelConfig,
    ModelLoadError,
    RopeConfig,
    activation,
    llama_shape,
    positive_int,
    rope_config,
    windows_from_layer_types,
)
from services.worker.model.decoder import DecoderLM
from services.worker.model.family import Family

if TYPE_CHECKING:
    from torch import Tensor

_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0
# Gemma's names for its four norms of a layer -> the Llama-layout names the shared fusion reads.
_NORM_NAMES = {
    "post_attention_layernorm": "attention_output_norm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_output_norm",
}


def config(raw: dict[str, Any]) -> ModelConfig:
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(
            "use_bidirectional_attention=true makes Gemma 3 an encoder, not a causal LM: set it to false"
        )
    layers = positive_int(raw, "num_hidden_layers")
    # Gemma 3's own defaults, where a config leaves them out.
    filled = {
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        **raw,
    }
    shape = llama_shape({**filled, "rope_parameters": None, "rope_scaling": None}, "Gemma3ForCausalLM")
    windows = windows_from_layer_types(raw, layers)
    if windows is None:
        pattern = int(raw.get("sliding_window_pattern", 6))
        window = positive_int(raw, "sliding_window")
        windows = tuple(window if (i + 1) % pattern else None for i in range(layers))
    full, local = _ropes(raw, shape.max_position_embeddings)
    return replace(
        shape,
        activation=activation(filled, "hidden_activation"),
        qk_norm=True,
        sandwich_norms=True,
        layer_windows=windows,
        rope=full,
        sliding_rope=local if windows else None,
        query_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_softcap=_cap(raw, "final_logit_softcapping"),
        embedding_scale=math.sqrt(shape.hidden_size),
    )


def _ropes(raw: dict[str, Any], max_pos: int) -> tuple[RopeConfig, RopeConfig]:
    """(global layers' RoPE, local layers' RoPE)."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = {"rope_theta": _GLOBAL_THETA, **(params.get("full_attention") or {})}
        local = {"rope_theta": _LOCAL_THETA, **(params.get("sliding_attention") or {})}
        return rope_config({}, full, max_pos), rope_config({}, local, max_pos)
    full = {"rope_theta": raw.get("rope_theta", _GLOBAL_THETA), **(raw.get("rope_scaling") or params)}
    local = {"rope_theta": raw.get("rope_local_base_freq", _LOCAL_THETA)}
    return rope_config({}, full, max_pos), rope_config({}, local, max_pos)


def _cap(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or value <= 0:
        raise ModelLoadError(f"config.json: {key}={value!r} must be a positive number or null")
    return float(value)


def checkpoint_names(config: ModelConfig) -> list[str]:
    names = llama_layout_names(config)
    for i in range(config.num_hidden_layers):
        names += [f"model.layers.{i}.{n}_feedforward_layernorm.weight" for n in ("pre", "post")]
    return names


def state_dict(hf: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    renamed: dict[str, Tensor] = {}
    for original, tensor in hf.items():
        prefix, _, rest = original.partition(".layers.")
        index, _, leaf = rest.partition(".")
        norm = leaf.removesuffix(".weight")
        name = f"{prefix}.layers.{index}.{_NORM_NAMES[norm]}.weight" if norm in _NORM_NAMES else original
        # (1 + weight) is Gemma's scale: stored so, the shared RMSNorm computes Gemma's norm.
        renamed[name] = tensor + 1.0 if name.endswith("norm.weight") else tensor
    # The attention and MLP output norms are not Llama-layout names: moved past the shared fusion.
    outputs = ("attention_output_norm.weight", "mlp_output_norm.weight")
    extra = {n: renamed.pop(n) for n in list(renamed) if n.endswith(outputs)}
    ours = llama_layout_state_dict(renamed, config)
    ours.update({n.removeprefix("model."): t for n, t in extra.items()})
    return ours


FAMILY = Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    config=config,
    build=DecoderLM,
    checkpoint_names=checkpoint_names,
    state_dict=state_dict,
)
