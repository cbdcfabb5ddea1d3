"""GGUF weights for tests: real blocks of every type the kernels serve, and ones they do not.

Types the gguf package can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are quantized from the given
floats with its own quantizer. The k-quants (Q4_K, Q5_K, Q6_K, and Q2_K, which has no kernel) have no
quantizer in the package: their blocks are random bytes with every float16 scale set to a small
finite value (some subnormal, some negative), which exercises every bit of the layout; the
reference for them is the package's own dequantization of the same bytes.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from services.worker.model.gguf_weight import GgufPart, GgufWeight

T = GGMLQuantizationType
SERVED_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# Byte offsets of each k-quant block's float16 fields.
_HALF_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82)}


def _halves(rng: np.random.Generator, count: int) -> np.ndarray:
    """Small float16 scales of both signs, a few of them subnormal."""
    values = rng.uniform(1e-4, 4e-3, count) * rng.choice([-1.0, 1.0], count)
    values[rng.random(count) < 0.05] = 3e-6  # below float16's smallest normal, 6.1e-5
    return np.asarray(values, dtype=np.float16)


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes per row]: real blocks of `qtype` holding about unit-scale values."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        return np.asarray(quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in _HALF_FIELDS[qtype]:
        blocks[:, offset : offset + 2] = _halves(rng, blocks.shape[0]).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def gguf_weight(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> GgufWeight:
    return GgufWeight([GgufPart(qtype, torch.from_numpy(random_blocks(qtype, rows, cols, seed)))])


def reference(weight: GgufWeight) -> torch.Tensor:
    """The gguf package's dequantization of every part, as float32."""
    return torch.cat([part.dequantize() for part in weight.parts])


def activation_block(qtype: T) -> int:
    """Values per activation scale on the integer path for weights of `qtype`: 256 for the K types
    (their super-block), 32 for the others."""
    return 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 32


def quantized_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """float64 [M, K]: x as the kernels' integer path sees it, 8 bits per `block` values
    (csrc/gguf_activations.h): d = max |x| / 127 and q = x / d rounded to nearest, ties to even, each
    step in float32 as the kernel takes it; the result is q * d, exact in float64."""
    blocks = x.numpy().astype(np.float32).reshape(x.shape[0], -1, block)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    nonzero = np.where(scale != 0, scale, np.float32(1))
    inverse = np.where(scale != 0, np.float32(1) / nonzero, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse)
    return torch.from_numpy((q.astype(np.float64) * scale.astype(np.float64)).reshape(x.shape))
