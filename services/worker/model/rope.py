"""Rotary position embeddings: inverse frequencies for each supported scaling type, and their use.

This module owns the RoPE arithmetic, written to match transformers' Llama bit for bit in float32
(same frequency formula, same float32 cos/sin, cast to the model dtype afterwards). The cos/sin of a
step are computed once per forward from the tokens' positions, never per layer, and never as a
full-length table: Llama 3.1's 131072 positions would cost more memory than a small model.
It must not know about the KV cache or batching.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from services.worker.model.config import ModelLoadError, RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> Tensor:
    """The float32 inverse frequencies [head_dim // 2] for the config's RoPE type."""
    # An explicit CPU device: the loader builds the model under a meta-device context, and this small
    # buffer must hold real values; moving the model to its device later carries it along.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    raise ModelLoadError(f"RoPE scaling type {rope.rope_type!r} is not supported")


def _llama3(inv_freq: Tensor, rope: RopeConfig) -> Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies; gives the cos/sin [T, 1, head_dim // 2] of a step's positions."""

    inv_freq: Tensor

    def __init__(self, rope: RopeConfig, dims: int) -> None:
        """`dims`: how many leading dims of each head it rotates (the head dim, or less for partial RoPE)."""
        super().__init__()
        # Not persistent: derived from the config, so checkpoints never need to carry it.
        self.register_buffer("inv_freq", inverse_frequencies(rope, dims), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[:, None].to(torch.float32) * self.inv_freq.to(positions.device)[None, :]
        cos = freqs.cos().to(dtype).unsqueeze(1)
        sin = freqs.sin().to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, head_dim] (half-split layout, as Hugging Face checkpoints store q/k)."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
