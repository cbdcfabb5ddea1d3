"""A 2-D weight as a GGUF file stores it: rows of ggml blocks, kept in their stored type.

`GgufWeight` is a [rows, cols] matrix made of one or more row ranges (`GgufPart`), each of one ggml
type (F32, F16, Q8_0, Q4_K, ...) holding its rows' blocks as bytes, exactly as read from the file (or
as int4_checkpoint.py repacks an AWQ/GPTQ projection). A Q4_K_M file quantizes q, k and v
differently, so our fused qkv projection is several parts. An `input_order` says the blocks hold the
columns in that order (a GPTQ act-order checkpoint's): the weight's product is x[:, input_order] times
the blocks. It takes part in a family's state-dict conversion as a tensor-like object (torch's
`__torch_function__` protocol): `torch.cat` along the rows joins parts, every other torch function is
refused with the reason, so no family's conversion silently computes on bytes. `dequantize` gives the
float tensor through the `gguf` package's own dequantization (the reference every kernel is held to).

This module owns the weight's bytes and their row layout; it must not read files (gguf_file.py does)
nor decide whether a weight is served as stored or dequantized (gguf_serving.py does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from services.worker.model.config import ModelLoadError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from torch import Tensor

# The types stored as plain floats: read straight into a tensor, never kept as blocks.
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass(frozen=True, slots=True)
class GgufPart:
    """Consecutive rows of one ggml type: `data` is uint8 [rows, bytes per row], as stored."""

    qtype: GGMLQuantizationType
    data: Tensor

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    def cols(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return int(self.data.shape[1]) // type_size * block_size

    def dequantize(self) -> Tensor:
        """float32 [rows, cols] by the gguf package's dequantization of these exact bytes."""
        values = quants.dequantize(self.data.numpy(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


class GgufWeight:
    """A [rows, cols] weight of GGUF row blocks (see the module docstring)."""

    def __init__(self, parts: Sequence[GgufPart], input_order: Tensor | None = None) -> None:
        if not parts:
            raise ValueError("a GGUF weight needs at least one part")
        widths = {part.cols() for part in parts}
        if len(widths) != 1:
            raise ValueError(f"the parts of a GGUF weight have different widths {sorted(widths)}")
        self.parts = tuple(parts)
        self.cols = widths.pop()
        self.input_order = input_order

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(part.rows for part in self.parts), self.cols)

    @property
    def qtypes(self) -> tuple[GGMLQuantizationType, ...]:
        """Each part's type, in row order."""
        return tuple(part.qtype for part in self.parts)

    def describe(self) -> str:
        """The types by name, in row order: "Q4_K", or "Q4_K+Q6_K" for a fused weight of two."""
        return "+".join(dict.fromkeys(q.name for q in self.qtypes))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight as a dense [rows, cols] tensor of `dtype`, its columns in their own order."""
        stored = torch.cat([part.dequantize() for part in self.parts])
        if self.input_order is None:
            return stored.to(dtype)
        weight = torch.empty_like(stored)
        weight[:, self.input_order] = stored
        return weight.to(dtype)

    def rows_reordered(self, order: Tensor) -> GgufWeight:
        """The same weight with its rows in `order` (a permutation of range(rows)); one part only,
        since a reordering would mix the rows of parts of different types."""
        if len(self.parts) != 1:
            raise ValueError("rows of a weight made of several parts cannot be reordered")
        part = self.parts[0]
        return GgufWeight([GgufPart(part.qtype, part.data[order].contiguous())], self.input_order)

    def __repr__(self) -> str:
        return f"GgufWeight({self.describe()}, shape={self.shape})"

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # A family's state dict concatenates q/k/v and gate/up along the rows; nothing else applies.
        kwargs = kwargs or {}
        if func is torch.cat:
            return _cat(*args, **kwargs)
        raise TypeError(
            f"torch.{getattr(func, '__name__', func)} is not defined on a GGUF weight kept in its stored "
            "type: a family's state dict may only rename GGUF weights or concatenate them along the rows"
        )


def _cat(tensors: Sequence[GgufWeight], dim: int = 0) -> GgufWeight:
    if dim != 0 or not all(isinstance(t, GgufWeight) for t in tensors):
        raise TypeError("GGUF weights concatenate only with each other and only along the rows (dim 0)")
    order = tensors[0].input_order
    if any(not _same_order(order, t.input_order) for t in tensors[1:]):
        raise ModelLoadError(
            "projections fused into one (q/k/v or gate/up) were quantized with different act-order "
            "column orders (g_idx), and one projection reads its input in one order: quantize the "
            "model again with the same g_idx for projections of one input, or with desc_act=false"
        )
    parts: list[GgufPart] = []
    for weight in tensors:
        for part in weight.parts:
            if parts and parts[-1].qtype == part.qtype:
                # Adjacent rows of one type are one part: one kernel call, not two.
                parts[-1] = GgufPart(part.qtype, torch.cat([parts[-1].data, part.data]))
            else:
                parts.append(part)
    return GgufWeight(parts, order)


def _same_order(a: Tensor | None, b: Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
