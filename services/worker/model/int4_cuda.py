"""Q4_0 and Q4_1 projections on CUDA, multiplied from their 4-bit values by PyTorch's int4 kernel.

An AWQ or GPTQ checkpoint's projections arrive as ggml Q4_0/Q4_1 blocks (int4_checkpoint.py), as do
a GGUF file's Q4_0 and Q4_1 weights. On CUDA they are multiplied by `torch.ops.aten._weight_int4pack_mm`
(tinygemm: the int4 tensor-core kernel of gpt-fast and torchao, built into every CUDA wheel of torch,
so serving int4 needs no package of its own and no CUDA toolchain). It reads 4-bit values with a
bfloat16 scale and zero per group of 32, 64, 128 or 256 input columns, a weight being
(q - 8) * scale + zero. A Q4_1 block (d * q + m) is that with scale d and zero m + 8d; a Q4_0 block
(d * (q - 8)) with zero 0. Consecutive blocks of a row with the same scale and zero (a checkpoint's
group of 64 to 256 columns) make one group, so the kernel reads the checkpoint's own group size.
Rounding scale and zero to bfloat16 (8 significant bits against float16's 11) moves a weight by up to
2^-9 of its scale times |q - 8|, plus 2^-9 of the zero: the rounding of the bfloat16 activations the
engine computes in on CUDA.

This module owns that conversion and the projection that calls the kernel; it must not decide what is
served as stored (gguf_serving.py does) nor read files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor, nn

if TYPE_CHECKING:
    from services.worker.model.gguf_weight import GgufPart, GgufWeight

KERNEL_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
"""The ggml types whose blocks are the kernel's 4-bit values with one scale and zero each."""
GROUP_SIZES = (256, 128, 64, 32)
"""The kernel's group sizes, largest first: the largest a weight's scales allow is taken."""
_BLOCK = 32
_ROW_TILE = 8  # the kernel's output rows come in tiles of 8
_MIN_CAPABILITY = (8, 0)  # tinygemm's tensor-core instructions need Ampere or later


@dataclass(frozen=True, slots=True)
class Int4Values:
    """A weight [rows, cols] as `values` (uint8, 0..15) and, per row and group of `group_size`
    columns, `scales_and_zeros` (float32 [cols / group_size, rows, 2]): weight = (q - 8) * scale + zero,
    in the layout the kernel reads once cast to bfloat16."""

    values: Tensor
    scales_and_zeros: Tensor
    group_size: int


def kernel_available(device: torch.device) -> bool:
    """Whether `device` runs the int4 kernel: a CUDA device of compute capability 8.0 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= _MIN_CAPABILITY


def servable(weight: GgufWeight) -> bool:
    """Whether the kernel multiplies by `weight`: every part Q4_0 or Q4_1, rows in tiles of 8."""
    rows, cols = weight.shape
    types_served = all(qtype in KERNEL_TYPES for qtype in weight.qtypes)
    return types_served and rows % _ROW_TILE == 0 and cols % _BLOCK == 0


def int4_values(weight: GgufWeight) -> Int4Values:
    """The kernel's values, scales and zeros of a weight every part of which is Q4_0 or Q4_1."""
    values, scales, zeros = zip(*(_part_values(part) for part in weight.parts), strict=True)
    scale, zero = torch.cat(scales), torch.cat(zeros)  # [rows, blocks]
    group_size = next(size for size in GROUP_SIZES if _one_per(size, weight.cols, scale, zero))
    span = group_size // _BLOCK
    pairs = torch.stack([scale[:, ::span], zero[:, ::span]], dim=2)
    return Int4Values(torch.cat(values), pairs.transpose(0, 1).contiguous(), group_size)


def _part_values(part: GgufPart) -> tuple[Tensor, Tensor, Tensor]:
    """(values uint8 [rows, cols], scale and zero float32 [rows, blocks]) of one Q4_0 or Q4_1 part."""
    blocks = part.data.reshape(part.rows, -1, GGML_QUANT_SIZES[part.qtype][1])
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).to(torch.float32)
    if part.qtype == GGMLQuantizationType.Q4_0:
        zero, nibbles = torch.zeros_like(d), blocks[..., 2:]
    else:
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).to(torch.float32)
        zero, nibbles = m + 8 * d, blocks[..., 4:]
    # ggml's byte j of a block holds value j in its low nibble and value j + 16 in its high one.
    values = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(part.rows, -1)
    return values, d, zero


def _one_per(group_size: int, cols: int, scale: Tensor, zero: Tensor) -> bool:
    """Whether every run of group_size / 32 blocks of a row shares one scale and one zero."""
    if cols % group_size:
        return False
    span = group_size // _BLOCK
    return all(bool((t.reshape(t.shape[0], -1, span) == t[:, ::span, None]).all()) for t in (scale, zero))


class TinygemmLinear(nn.Module):
    """A projection y = x . W^T + bias from a Q4_0/Q4_1 weight's 4-bit values, on a CUDA device."""

    bias: Tensor | None
    input_order: Tensor | None
    """The column order the values hold (a GPTQ act-order projection's), or None for their own."""

    def __init__(
        self, int4: Int4Values, input_order: Tensor | None, bias: Tensor | None, device: torch.device
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = int4.values.shape
        self.group_size = int4.group_size
        # The kernel takes two values a byte, the even column in the high nibble; paired before the
        # move, so half the bytes cross to the device.
        pairs = ((int4.values[:, ::2] << 4) | int4.values[:, 1::2]).to(device).contiguous()
        inner_k_tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", int4.scales_and_zeros.to(device, torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.to(device, torch.bfloat16))
        self.register_buffer("input_order", None if input_order is None else input_order.to(device))

    @classmethod
    def from_weight(cls, weight: GgufWeight, bias: Tensor | None, device: torch.device) -> TinygemmLinear:
        """The projection of a weight `servable` accepts, its buffers on `device`."""
        return cls(int4_values(weight), weight.input_order, bias, device)

    def forward(self, x: Tensor) -> Tensor:
        leading = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        rows = (rows if self.input_order is None else rows.index_select(1, self.input_order)).contiguous()
        out: Tensor = torch.ops.aten._weight_int4pack_mm(
            rows, self.packed, self.group_size, self.scales_and_zeros
        )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*leading, self.out_features)
