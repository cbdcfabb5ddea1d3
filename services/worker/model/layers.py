"""The building blocks of a Llama-family decoder layer: RMSNorm, attention projections, SwiGLU MLP.

This module owns the per-layer arithmetic, in the same order as transformers' Llama so float32
results agree to rounding. Projections are fused (q/k/v in one matmul, gate/up in another) because
on a small CPU model the number of matmul calls is a visible share of a step. It must not know how
the KV cache is laid out: attention goes through the `AttentionBackend` it is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.worker.model.rope import apply_rotary
from services.worker.model.small_linear import project

if TYPE_CHECKING:
    from services.worker.model.attention import AttentionBackend, AttentionMetadata
    from services.worker.model.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # Lower precision: normalise in float32, round, then scale, exactly as transformers does.
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, RoPE on q and k, paged attention, output projection."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.backend = backend

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        layer_cache: tuple[Tensor, Tensor],
    ) -> Tensor:
        qkv = project(self.qkv_proj, x).view(x.shape[0], -1, self.head_dim)
        rotated_heads = self.num_heads + self.num_kv_heads
        qk = apply_rotary(qkv[:, :rotated_heads], cos, sin)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, rotated_heads:]
        out = self.backend.forward(q, k, v, layer_cache, meta, self.scale)
        result: Tensor = project(self.o_proj, out)
        return result


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = project(self.gate_up_proj, x)
        gate = gate_up[:, : self.intermediate_size]
        up = gate_up[:, self.intermediate_size :]
        result: Tensor = project(self.down_proj, F.silu(gate) * up)
        return result


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual connection."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        layer_cache: tuple[Tensor, Tensor],
    ) -> Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, meta, layer_cache)
        x = x + attended
        mlp_out: Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp_out
