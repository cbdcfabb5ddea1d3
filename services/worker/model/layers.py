"""The building blocks of a decoder layer: RMSNorm, attention with its projections, the gated MLP.

This module owns the per-layer arithmetic of every family, in the same order as transformers' so
float32 results agree to rounding, and the ways families differ inside a layer, each read from the
ModelConfig: q/k norms (Qwen3, Gemma 3), norms on each block's output (Gemma 3), partial RoPE,
per-layer sliding windows and RoPE, the attention's scale, the MLP's activation.
Projections are fused (q/k/v in one matmul, gate/up in another) because on a small CPU model the
number of matmul calls is a visible share of a step. It must not know how the KV cache is laid out
(attention goes through the `AttentionBackend` it is given) nor any family's checkpoint names.
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
    from services.worker.model.lora import LoraLayer


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


class Attention(nn.Module):
    """Fused q/k/v projection, optional q/k norms, RoPE on q and k, paged attention, output projection."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotated_dims
        self.scale = config.attention_scale
        self.window = config.window(layer)
        self.qkv_proj = nn.Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.backend = backend
        self.lora: LoraLayer | None = None
        """The layer's adapter slots, where the model serves LoRA adapters (decoder.py attaches them)."""

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        layer_cache: tuple[Tensor, Tensor],
    ) -> Tensor:
        fused = project(self.qkv_proj, x)
        if self.lora is not None:
            self.lora.add("qkv", x, fused)
        qkv = fused.view(x.shape[0], -1, self.head_dim)
        rotated_heads = self.num_heads + self.num_kv_heads
        if self.q_norm is not None and self.k_norm is not None:
            # qkv is this call's own fresh tensor: normalising its q and k heads in place is safe.
            self._norm_heads(qkv, 0, self.num_heads, self.q_norm)
            self._norm_heads(qkv, self.num_heads, rotated_heads, self.k_norm)
        kernels = native.library() if _rotates_in_place(qkv, cos, sin, self.rotary_dim) else None
        if kernels is not None:
            tokens, heads_total, dim = qkv.shape
            angles = (cos.data_ptr(), sin.data_ptr())
            kernels.rotary(qkv.data_ptr(), *angles, tokens, heads_total, rotated_heads, dim)
            qk = qkv[:, :rotated_heads]
        elif self.rotary_dim == self.head_dim:
            qk = apply_rotary(qkv[:, :rotated_heads], cos, sin)
        else:
            heads = qkv[:, :rotated_heads]
            rotated = apply_rotary(heads[..., : self.rotary_dim], cos, sin)
            qk = torch.cat((rotated, heads[..., self.rotary_dim :]), dim=-1)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, rotated_heads:]
        out = self.backend.forward(q, k, v, layer_cache, meta, self.scale, self.window)
        result: Tensor = project(self.o_proj, out)
        if self.lora is not None:
            self.lora.add("o", out, result)
        return result

    def _norm_heads(self, qkv: Tensor, first: int, end: int, norm: RMSNorm) -> None:
        heads = qkv[:, first:end]
        qkv[:, first:end] = norm(heads.reshape(-1, self.head_dim)).view(heads.shape)


def _rotates_in_place(qkv: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> bool:
    cpu32 = qkv.device.type == "cpu" and qkv.dtype == cos.dtype == torch.float32
    whole = rotary_dim == qkv.shape[-1]
    return cpu32 and whole and qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with act SiLU (SwiGLU) or tanh-GELU (GeGLU); gate and up fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gelu = config.activation == "gelu_tanh"
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.lora: LoraLayer | None = None

    def forward(self, x: Tensor) -> Tensor:
        gate_up = project(self.gate_up_proj, x)
        if self.lora is not None:
            self.lora.add("gate_up", x, gate_up)
        gate = gate_up[:, : self.intermediate_size]
        up = gate_up[:, self.intermediate_size :]
        activated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        hidden = activated * up
        result: Tensor = project(self.down_proj, hidden)
        if self.lora is not None:
            self.lora.add("down", hidden, result)
        return result


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual connection.

    The residual add of each block is fused into the norm that follows it: a layer takes the previous
    layer's MLP output (`delta`, None for the first layer) and the residual stream, and returns its
    own MLP output and the residual stream; the model's final norm makes the last add. With sandwich
    norms each block's output is normed before its add (`attention_output_norm`, `mlp_output_norm`).
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)
        self.attention_output_norm: RMSNorm | None = None
        self.mlp_output_norm: RMSNorm | None = None
        if config.sandwich_norms:
            self.attention_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        if self.attention_output_norm is not None:
            attended = self.attention_output_norm(attended)
        normed, residual = self.post_attention_layernorm.add(attended, residual)
        mlp_out: Tensor = self.mlp(normed)
        if self.mlp_output_norm is not None:
            mlp_out = self.mlp_output_norm(mlp_out)
        return mlp_out, residual
