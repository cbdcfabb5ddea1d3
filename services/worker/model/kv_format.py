"""How the paged cache stores one token's keys (or values) of one KV head: the formats of
`engine.kv_cache_dtype`, their bytes, and the conversions between a step's rows and them.

A float32, bfloat16 or float16 row is the head_dim values in that dtype. An fp8_e4m3 row (CUDA) is
them cast to float8_e4m3fn, clamped to its finite range first (the cast has no infinity). An int8
row is head_dim int8 values and then one float32 scale in its last 4 bytes: scale = max |x| times
float32's 1/127, q = x / scale rounded to nearest, ties to even (0 where the row is all zeros, or
where x is infinite), x ~ q * scale. Where head_dim is a power of two (every model served here), x is
the row rotated first by the normalized Walsh-Hadamard matrix H (orthogonal and its own inverse):
a few channels of a key row carry most of its magnitude, and one scale per row then leaves the other
channels a handful of levels; the rotation spreads that magnitude over every channel before the
rounding (QuaRot's remedy) and is undone on reading, at no cost in bytes. Attention need not undo it
row by row: q . k = Hq . Hk and the weighted sum of Hv is H times that of v, so the native kernel
rotates the query and the output once instead. The rotation is butterflies in float32, the same
additions in the same order here and in the kernel. A row carries its own scale, so a block is
quantized once, when its tokens are written (prefill and decode alike), and never again; the block
manager's moves (prefix sharing, preemption, failover replays) stay byte copies of whole blocks.
csrc/paged_attention.cpp writes and reads the same int8 rows, and its rotation and quantization are
this module's to the bit. This module must not allocate the cache (kv_cache.py does) nor attend
(attention.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

SCALE_BYTES = 4  # an int8 row's float32 scale
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
INV_127 = float(np.float32(1.0) / np.float32(127.0))  # float32's 1/127, exact as a double
# engine.kv_cache_dtype's names for the formats a model's own dtype does not give.
_NAMED = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# csrc/paged_attention.cpp's format ids, for the formats it reads in place.
NATIVE_FLOAT32, NATIVE_INT8 = 0, 1


@dataclass(frozen=True, slots=True)
class KVFormat:
    """One cache row format: its storage dtype, and whether rows carry an int8 scale."""

    name: str
    storage: torch.dtype

    @property
    def scaled(self) -> bool:
        """Whether each row is int8 values followed by their float32 scale."""
        return self.storage == torch.int8

    @property
    def native_id(self) -> int | None:
        """csrc/paged_attention.cpp's id for this format, or None where it cannot read it."""
        if self.storage == torch.float32:
            return NATIVE_FLOAT32
        return NATIVE_INT8 if self.scaled else None

    def row_width(self, head_dim: int) -> int:
        """Elements of `storage` one row takes."""
        return head_dim + SCALE_BYTES if self.scaled else head_dim

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one row takes, its scale included."""
        return self.row_width(head_dim) * torch.empty((), dtype=self.storage).element_size()

    def pack(self, rows: Tensor) -> Tensor:
        """[..., head_dim] rows as this format stores them ([..., row_width])."""
        if self.scaled:
            return quantize_int8(hadamard(rows) if rotated(rows.shape[-1]) else rows)
        if self.storage == torch.float8_e4m3fn:
            return rows.clamp(-FP8_MAX, FP8_MAX).to(self.storage)
        return rows.to(self.storage)

    def unpack(self, stored: Tensor, dtype: torch.dtype) -> Tensor:
        """Stored rows [..., row_width] (any strides the cache's views give) as `dtype` values."""
        if self.scaled:
            head_dim = stored.shape[-1] - SCALE_BYTES
            if rotated(head_dim):
                return hadamard(dequantize_int8(stored, torch.float32)).to(dtype)
            return dequantize_int8(stored, dtype)
        return stored if stored.dtype == dtype else stored.to(dtype)


def stored_in(storage: torch.dtype) -> KVFormat:
    """The format of a cache whose tensors are `storage`: int8 means scaled int8 rows, float8 the
    fp8_e4m3 cast, any other dtype rows as computed."""
    if storage == torch.int8:
        return KVFormat("int8", storage)
    if storage == torch.float8_e4m3fn:
        return KVFormat("fp8_e4m3", storage)
    return plain(storage)


def plain(dtype: torch.dtype) -> KVFormat:
    """Rows stored as they are computed, in `dtype`."""
    return KVFormat(str(dtype).removeprefix("torch."), dtype)


def resolve(setting: str, model_dtype: torch.dtype, device: str | torch.device) -> KVFormat:
    """engine.kv_cache_dtype's format for a model of `model_dtype` on `device`; "auto" is the model's
    own dtype. Raises ValueError naming the setting and its fix."""
    if setting == "auto":
        return plain(model_dtype)
    if setting not in _NAMED:
        raise ValueError(
            f"engine.kv_cache_dtype={setting!r} is not a cache format: use one of auto, {', '.join(_NAMED)}"
        )
    if setting == "fp8_e4m3" and torch.device(device).type != "cuda":
        raise ValueError(
            f"engine.kv_cache_dtype='fp8_e4m3' needs a CUDA device (this worker runs on {device}): "
            "use int8 on the CPU"
        )
    return KVFormat(setting, _NAMED[setting])


def rotated(head_dim: int) -> bool:
    """Whether int8 rows of this head_dim are stored rotated: a power of two has a Hadamard matrix."""
    return head_dim > 1 and head_dim & (head_dim - 1) == 0


def hadamard(rows: Tensor) -> Tensor:
    """[..., n] float32 rows times the normalized n x n Walsh-Hadamard matrix (n a power of two), by
    csrc/paged_attention.cpp's butterflies: at each width h = 1, 2, 4, ..., the pair (a, b) = values
    (j, j + h) of every run of 2h becomes (a + b, a - b); then a product by float32's 1/sqrt(n)."""
    n = rows.shape[-1]
    lead = rows.shape[:-1]
    x = rows.to(torch.float32)
    width = 1
    while width < n:
        pairs = x.reshape(*lead, n // (2 * width), 2, width)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*lead, n)
        width *= 2
    return x * float(np.float32(1.0) / np.sqrt(np.float32(n)))


def quantize_int8(rows: Tensor) -> Tensor:
    """[..., head_dim] rows as int8 rows [..., head_dim + 4]: the values, then their scale's bytes."""
    x = rows.to(torch.float32)
    # A product by float32's 1/127, not a division by 127: torch may turn a division by a scalar
    # into a product by its reciprocal, and the kernel's quantize_row must round as this does.
    scale = x.abs().amax(dim=-1, keepdim=True) * INV_127
    # x / scale elementwise in float32, rounded half to even: quantize_row, operation for operation.
    # A NaN quotient (an infinite x) stores 0, as the kernel does; the row's scale keeps the damage.
    q = torch.where(scale > 0, x / scale, torch.zeros_like(x)).nan_to_num_(nan=0.0).round_().to(torch.int8)
    head_dim = rows.shape[-1]
    out = torch.empty((*rows.shape[:-1], head_dim + SCALE_BYTES), dtype=torch.int8, device=rows.device)
    out[..., :head_dim] = q
    out[..., head_dim:].view(torch.float32).copy_(scale)
    return out


def dequantize_int8(stored: Tensor, dtype: torch.dtype) -> Tensor:
    """int8 rows [..., head_dim + 4] as their values q * scale, in `dtype`."""
    head_dim = stored.shape[-1] - SCALE_BYTES
    scale = stored[..., head_dim:].view(torch.float32)
    return (stored[..., :head_dim].to(torch.float32) * scale).to(dtype)
