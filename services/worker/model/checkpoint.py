"""Llama's checkpoint layout, which most families share: its tensor names and their fusion into ours.

A Llama-layout checkpoint (transformers' naming) stores `model.embed_tokens`, `model.norm`, an
optional `lm_head`, and per layer `input_layernorm`, `post_attention_layernorm`, separate q/k/v/o
projections (with biases where the config says), optional per-head `q_norm`/`k_norm`, and separate
gate/up/down projections. This module owns that naming and the fusion into our modules (q/k/v into
`qkv_proj`, gate/up into `gate_up_proj`), for the family modules to use and extend; it must not know
which family a checkpoint is (each family's module does) nor read files (the loader does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import Tensor

    from services.worker.model.config import ModelConfig


def llama_layout_names(config: ModelConfig) -> list[str]:
    """Every tensor name the config says a Llama-layout checkpoint must hold."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        names += [prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"{prefix}self_attn.{proj}.weight")
            has_bias = config.o_proj_bias if proj == "o_proj" else config.attention_bias
            if has_bias:
                names.append(f"{prefix}self_attn.{proj}.bias")
        if config.qk_norm:
            names += [f"{prefix}self_attn.q_norm.weight", f"{prefix}self_attn.k_norm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"{prefix}mlp.{proj}.weight")
            if config.mlp_bias:
                names.append(f"{prefix}mlp.{proj}.bias")
    return names


def llama_layout_state_dict(hf: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Rename to our modules and concatenate q/k/v and gate/up along the output dimension.

    The separate projections are popped from `hf` as they are fused, so a large model's peak memory
    holds each weight about once, not twice.
    """
    ours = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not config.tie_word_embeddings:
        ours["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            ours[f"{dst}{norm}.weight"] = hf[f"{src}{norm}.weight"]
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                ours[f"{dst}self_attn.{norm}.weight"] = hf[f"{src}self_attn.{norm}.weight"]
        for kind in ("weight", "bias"):
            qkv = [f"{src}self_attn.{p}_proj.{kind}" for p in "qkv"]
            if qkv[0] in hf:
                ours[f"{dst}self_attn.qkv_proj.{kind}"] = torch.cat([hf.pop(n) for n in qkv])
            if f"{src}self_attn.o_proj.{kind}" in hf:
                ours[f"{dst}self_attn.o_proj.{kind}"] = hf[f"{src}self_attn.o_proj.{kind}"]
            gate_up = [f"{src}mlp.{p}_proj.{kind}" for p in ("gate", "up")]
            if gate_up[0] in hf:
                ours[f"{dst}mlp.gate_up_proj.{kind}"] = torch.cat([hf.pop(n) for n in gate_up])
            if f"{src}mlp.down_proj.{kind}" in hf:
                ours[f"{dst}mlp.down_proj.{kind}"] = hf[f"{src}mlp.down_proj.{kind}"]
    return ours
