"""Weight-only int8 copies of a model's projections for small batches: the int8 fallback's decode path.

A decode step at a few rows reads every weight once and is bound by memory, so its cost is the bytes
of the weights. `SmallBatchInt8` wraps one projection: at most small_linear.MAX_ROWS rows on the CPU
go through the native kernel over an int8 copy of the weight with one float32 scale per output row
(csrc/small_linear.cpp widens each int8 to float32 in registers; the activations stay float32, so the
outlier channels that keep down_proj out of the dynamic path lose nothing); larger batches, and any
machine without the kernels, go through the module it wraps (`large`), unchanged. The copy is made
once, from the float32 weight, before that module is itself quantized. This module owns the copies
and the choice between them; it must not decide which projections are wrapped (dynamic_int8.py
does) nor read checkpoints.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from services.worker.model import native
from services.worker.model.small_linear import small_batch

# Symmetric int8: the largest magnitude of each row maps to 127, zero stays zero.
_INT8_MAX = 127.0


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 [N, K], float32 scale [N]) with weight ~= int8 * scale[:, None], one scale per row."""
    dense = weight.detach().to(torch.float32)
    # A row of zeros gets scale 1 (all its int8 are 0): no division by zero, the product stays 0.
    peak = dense.abs().amax(dim=1)
    scale = torch.where(peak > 0, peak / _INT8_MAX, torch.ones_like(peak))
    quantized = torch.round(dense / scale[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return quantized.contiguous(), scale.contiguous()


class SmallBatchInt8(nn.Module):
    """A projection whose small batches read an int8 copy of its weight; others run `large` itself."""

    weight_int8: Tensor
    scale: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight_int8, scale = quantize_rows(linear.weight)
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale)
        bias = linear.bias.detach().to(torch.float32).contiguous() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.large: nn.Module = linear
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        kernels = native.library() if self._applies(x) else None
        if kernels is None:
            result: Tensor = self.large(x)
            return result
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        bias = self.bias
        kernels.small_linear_int8(
            x.data_ptr(),
            self.weight_int8.data_ptr(),
            self.scale.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            out.data_ptr(),
            x.shape[0],
            self.out_features,
            self.in_features,
        )
        return out

    def _applies(self, x: Tensor) -> bool:
        return small_batch(x) and self.weight_int8.device.type == "cpu"
