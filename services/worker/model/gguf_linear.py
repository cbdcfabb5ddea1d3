"""Projections and embeddings whose weights stay in their GGUF block types (csrc/gguf_linear.cpp).

`GgufLinear` holds a projection's weight as the file stored it (one buffer of blocks per part, a
part per type: a Q4_K_M file's fused q/k/v may be three) and computes y = x . W^T + bias from the
blocks. Up to NATIVE_MAX_ROWS rows (decode steps, and the few rows a step projects to the
vocabulary), the native kernel reads the blocks where they are used, so only the stored bytes cross
the memory bus: up to eight rows (a decode step of the decode stack) it rounds x to 8 bits per 32
values (per 256 for the K types) and multiplies those with the stored quants in integers, as
llama.cpp does (about 0.5% of a row's scale from the float32 product; set_integer_activations turns
that off); above, it dequantizes a few weight rows at a time into a buffer of its own for the float32
kernel. With AVX-512 VNNI, parts of every type but Q4_1 and Q5_1 stay on the integer path at any
batch size (the kernel's tiled GEMMs, `any_rows`): prefill chunks then compute what decode steps do.
On each path a row's result does not depend on its batch. Larger batches of the other parts (prefill
chunks, whose rows of x no longer stay in cache) pay one dequantization per call into a scratch buffer
shared by every layer of the thread, then torch's GEMM does the rest; the vocabulary projection, the largest
weight (Qwen's is 545 MB as float32), stays below the bound at any decode step of up to 64 sequences
and never needs the scratch.
`GgufEmbedding` dequantizes the rows a step looks up. Without the kernels (turned off after load)
both fall back to the gguf package's numpy dequantization: correct, slow, and only for
comparisons. This module owns those modules and their calls; it must not decide which weights are
kept as stored (gguf_serving.py does) nor read files.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.worker.model import native
from services.worker.model.gguf_weight import GgufPart, GgufWeight

# Above this many rows x leaves the cache while a weight tile is multiplied: dequantize-then-GEMM wins.
NATIVE_MAX_ROWS = 64

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

_scratch = threading.local()


def set_integer_activations(kernels: native.Library, on: bool) -> bool:
    """Whether batches of up to eight rows multiply x, rounded to 8 bits per 32 values (per 256 for the
    K types), with the stored quants in integers (on, the default: llama.cpp's arithmetic, and the fast
    one), or take the float32 kernel on dequantized tiles (off: the float32 model of the dequantized
    file bit for bit, for parity checks against transformers). Process-wide; returns the previous
    setting."""
    previous: int = kernels.gguf_set_integer_rows(int(on))
    return previous == 1


def supported(weight: GgufWeight, kernels: native.Library) -> bool:
    """Whether the native kernels compute from every part of `weight` as stored."""
    return all(kernels.gguf_supported(int(part.qtype), weight.cols) == 1 for part in weight.parts)


def _scratch_matrix(rows: int, cols: int) -> Tensor:
    """A float32 [rows, cols] view of this thread's scratch buffer, grown to the largest weight seen."""
    buffer: Tensor | None = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < rows * cols:
        # A normal tensor even when made under inference_mode, so later calls outside it may write it.
        with torch.inference_mode(False):
            buffer = torch.empty(rows * cols, dtype=torch.float32)
        _scratch.buffer = buffer
    return buffer[: rows * cols].view(rows, cols)


def _dequantize_into(
    kernels: native.Library | None, qtype: GGMLQuantizationType, data: Tensor, out: Tensor
) -> None:
    """Rows of blocks `data` into the contiguous float32 rows `out`: the native kernel, or without it
    the gguf package's numpy dequantization."""
    if kernels is None:
        out.copy_(GgufPart(qtype, data).dequantize())
    else:
        kernels.gguf_dequantize(int(qtype), data.data_ptr(), out.data_ptr(), data.shape[0], out.shape[1])


class _Stored(nn.Module):
    """The parts of one GGUF weight as buffers `part0`, `part1`, ... with their types and rows."""

    def __init__(self, weight: GgufWeight) -> None:
        super().__init__()
        self.qtypes = weight.qtypes
        self.in_features = weight.cols
        self.out_features = weight.shape[0]
        for index, part in enumerate(weight.parts):
            self.register_buffer(f"part{index}", part.data.contiguous())

    def stored_parts(self) -> list[tuple[GGMLQuantizationType, Tensor]]:
        return [(qtype, getattr(self, f"part{i}")) for i, qtype in enumerate(self.qtypes)]

    def stored_weight(self) -> GgufWeight:
        return GgufWeight([GgufPart(qtype, data) for qtype, data in self.stored_parts()])

    def format(self) -> str:
        """The stored types by name ("Q4_K", "Q4_K+Q6_K")."""
        return self.stored_weight().describe()

    def dequantize_rows(self, kernels: native.Library | None, out: Tensor) -> Tensor:
        """Every row of the weight into `out` [out_features, in_features] float32."""
        row = 0
        for qtype, data in self.stored_parts():
            _dequantize_into(kernels, qtype, data, out[row : row + data.shape[0]])
            row += data.shape[0]
        return out


class GgufLinear(_Stored):
    """A projection computed from its GGUF blocks (see the module docstring)."""

    bias: Tensor | None
    input_order: Tensor | None
    """The column order the blocks hold (a GPTQ act-order projection's), or None for their own."""

    def __init__(self, weight: GgufWeight, bias: Tensor | None = None) -> None:
        super().__init__(weight)
        self.register_buffer("bias", None if bias is None else bias.to(torch.float32).contiguous())
        self.register_buffer("input_order", weight.input_order)

    def stored_weight(self) -> GgufWeight:
        return GgufWeight(super().stored_weight().parts, self.input_order)

    def forward(self, x: Tensor) -> Tensor:
        leading = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        rows = (rows if self.input_order is None else rows.index_select(1, self.input_order)).contiguous()
        kernels = native.library()
        m = rows.shape[0]
        if kernels is not None and m > 0 and (m <= NATIVE_MAX_ROWS or self.any_rows(kernels)):
            out = self.from_blocks(kernels, rows)
        else:
            out = self.from_dequantized(kernels, rows)
        return out.reshape(*leading, self.out_features)

    def any_rows(self, kernels: native.Library) -> bool:
        """Whether the native kernel takes batches of any size on some part (the tiled integer GEMM)."""
        return any(kernels.gguf_any_rows(int(qtype)) == 1 for qtype in self.qtypes)

    def from_dequantized(self, kernels: native.Library | None, x: Tensor) -> Tensor:
        """x [M, K] float32 contiguous times the whole weight dequantized into the thread's scratch."""
        weight = self.dequantize_rows(kernels, _scratch_matrix(self.out_features, self.in_features))
        return F.linear(x, weight, self.bias)

    def from_blocks(self, kernels: native.Library, x: Tensor) -> Tensor:
        """x [M, K] float32 contiguous times the weight through the native kernel, from the blocks; above
        NATIVE_MAX_ROWS rows a part the kernel does not take at any size (a fused weight of mixed types)
        is dequantized into the thread's scratch for torch's GEMM instead."""
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        row = 0
        for qtype, data in self.stored_parts():
            rows = data.shape[0]
            if m > NATIVE_MAX_ROWS and kernels.gguf_any_rows(int(qtype)) == 0:
                weight = _scratch_matrix(rows, self.in_features)
                _dequantize_into(kernels, qtype, data, weight)
                bias = self.bias[row : row + rows] if self.bias is not None else None
                out[:, row : row + rows] = F.linear(x, weight, bias)
            else:
                bias_at = self.bias.data_ptr() + row * 4 if self.bias is not None else None
                kernels.gguf_linear(
                    int(qtype),
                    x.data_ptr(),
                    data.data_ptr(),
                    bias_at,
                    out.data_ptr() + row * 4,
                    m,
                    rows,
                    self.in_features,
                    self.out_features,
                )
            row += rows
        return out


class GgufEmbedding(_Stored):
    """Token embeddings looked up in their GGUF blocks: only the rows a step uses are dequantized."""

    def __init__(self, weight: GgufWeight) -> None:
        super().__init__(weight)
        if len(self.qtypes) != 1:
            raise ValueError("an embedding table is one GGUF tensor of one type")

    def forward(self, ids: Tensor) -> Tensor:
        qtype, data = self.stored_parts()[0]
        picked = data.index_select(0, ids.reshape(-1)).contiguous()
        out = torch.empty(picked.shape[0], self.in_features, dtype=torch.float32)
        _dequantize_into(native.library(), qtype, picked, out)
        return out.reshape(*ids.shape, self.in_features)
