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

from services.worker.model import native
from services.worker.model.rope import apply_rotary
from services.worker.model.small_linear import project

if TYPE_CHECKING:
    from services.worker.model.attention import AttentionBackend, AttentionMetadata
    from services.worker.model.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight.

    `add` fuses the residual add before the norm: on the CPU in float32 both are one native pass over
    each row (csrc/rms_norm.cpp), since torch's rms_norm costs about ten operators per call.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: Tensor) -> Tensor:
        kernels = self._kernels(x)
        if kernels is not None:
            return self._native(kernels, x, None)[0]
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # Lower precision: normalise in float32, round, then scale, exactly as transformers does.
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def add(self, delta: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(residual + delta), residual + delta): the residual stream's next value and its norm."""
        kernels = self._kernels(delta)
        if kernels is not None:
            return self._native(kernels, delta, residual)
        summed = residual + delta
        return self(summed), summed

    def _kernels(self, x: Tensor) -> native.Library | None:
        cpu32 = x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32 and x.dim() == 2
        return native.library() if cpu32 and x.is_contiguous() else None

    def _native(self, kernels: native.Library, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        out = torch.empty_like(x)
        summed = torch.empty_like(x) if residual is not None else x
        # Held in a name so a contiguous copy outlives the call that reads it.
        dense = residual.contiguous() if residual is not None else None
        kernels.rms_norm(
            x.data_ptr(),
            dense.data_ptr() if dense is not None else None,
            self.weight.data_ptr(),
            summed.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            self.eps,
        )
        return out, summed


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
        kernels = native.library() if _rotates_in_place(qkv, cos, sin) else None
        if kernels is not None:
            # qkv is this call's own fresh tensor: rotating its q and k heads in place is safe.
            tokens, heads_total, dim = qkv.shape
            angles = (cos.data_ptr(), sin.data_ptr())
            kernels.rotary(qkv.data_ptr(), *angles, tokens, heads_total, rotated_heads, dim)
            qk = qkv[:, :rotated_heads]
        else:
            qk = apply_rotary(qkv[:, :rotated_heads], cos, sin)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, rotated_heads:]
        out = self.backend.forward(q, k, v, layer_cache, meta, self.scale)
        result: Tensor = project(self.o_proj, out)
        return result


def _rotates_in_place(qkv: Tensor, cos: Tensor, sin: Tensor) -> bool:
    cpu32 = qkv.device.type == "cpu" and qkv.dtype == cos.dtype == torch.float32
    return cpu32 and qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()


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
    """Pre-norm attention block then pre-norm MLP block, each with a residual connection.

    The residual add of each block is fused into the norm that follows it: a layer takes the previous
    layer's MLP output (`delta`, None for the first layer) and the residual stream, and returns its
    own MLP output and the residual stream; the model's final norm makes the last add.
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        delta: Tensor | None,
        residual: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        layer_cache: tuple[Tensor, Tensor],
    ) -> tuple[Tensor, Tensor]:
        if delta is None:
            normed = self.input_layernorm(residual)
        else:
            normed, residual = self.input_layernorm.add(delta, residual)
        attended = self.self_attn(normed, cos, sin, meta, layer_cache)
        normed, residual = self.post_attention_layernorm.add(attended, residual)
        mlp_out: Tensor = self.mlp(normed)
        return mlp_out, residual
