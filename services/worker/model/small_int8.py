"""Weight-only int8 projections: int8 weights with one scale per row, float32 activations.

`WeightOnlyInt8` holds one projection's int8 copy of its weight (one float32 scale per output row) and
computes x . (int8 * scale)^T + bias through the native kernel (csrc/small_linear.cpp widens each
int8 to float32 in registers; the activations stay float32, so the outlier channels that keep
down_proj out of torch's dynamic path lose nothing). It takes any number of rows, MAX_ROWS to a call:
every output element is one kernel tile's sum over its row of x, whatever the other rows are, so a
row's result does not depend on its batch (the int8 variant's `int8-weight-only` mode relies on
that). Without the kernels (turned off, or unbuildable) it multiplies by a dequantized copy through
torch, whose GEMM gives no such promise. `SmallBatchInt8` is the `dynamic-int8` mode's projection: the
same copy for batches of at most small_linear.MAX_ROWS rows, its wrapped module (`large`, torch's
dynamic int8 or the float32 layer) for larger ones. The copy is made once, from the float32 weight,
before that module is itself quantized. This module owns the copies and, per call, the choice
between them; it must not decide which projections are wrapped (dynamic_int8.py does) nor read
checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.worker.model import native
from services.worker.model.small_linear import MAX_ROWS, small_batch

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


class WeightOnlyInt8(nn.Module):
    """A projection that reads only its int8 copy, at every batch size (no float32 weight is kept)."""

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
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        kernels = native.library() if self._native_applies(x) else None
        if kernels is None:
            return self._dequantized(x)
        return self._native(kernels, x)

    def _native_applies(self, x: Tensor) -> bool:
        # small_batch is the kernel's input contract; chunks of MAX_ROWS rows keep to its row limit.
        return small_batch(x[:MAX_ROWS]) and self.weight_int8.device.type == "cpu"

    def _native(self, kernels: native.Library, x: Tensor) -> Tensor:
        """x . (int8 * scale)^T + bias through the kernel, MAX_ROWS rows to a call (the shape it is tuned
        for, its rows of x in L1); a row's bits are the same in any chunk."""
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        bias = self.bias.data_ptr() if self.bias is not None else None
        row_bytes = (x.shape[1] * x.element_size(), self.out_features * out.element_size())
        for start in range(0, rows, MAX_ROWS):
            kernels.small_linear_int8(
                x.data_ptr() + start * row_bytes[0],
                self.weight_int8.data_ptr(),
                self.scale.data_ptr(),
                bias,
                out.data_ptr() + start * row_bytes[1],
                min(MAX_ROWS, rows - start),
                self.out_features,
                self.in_features,
            )
        return out

    def _dequantized(self, x: Tensor) -> Tensor:
        """The same product through torch, on a float copy made for this call only."""
        weight = self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return F.linear(x, weight, self.bias.to(x.dtype) if self.bias is not None else None)


class SmallBatchInt8(WeightOnlyInt8):
    """A projection whose small batches read an int8 copy of its weight; others run `large` itself."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.large: nn.Module = linear

    def forward(self, x: Tensor) -> Tensor:
        kernels = native.library() if self._small(x) else None
        if kernels is None:
            result: Tensor = self.large(x)
            return result
        return self._native(kernels, x)

    def _small(self, x: Tensor) -> bool:
        return small_batch(x) and self.weight_int8.device.type == "cpu"
