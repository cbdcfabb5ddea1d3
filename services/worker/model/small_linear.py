"""Linear layers at small batch sizes: the native matrix-vector kernel where it pays, F.linear elsewhere.

At a decode step's batch sizes a linear layer is a matrix-vector product whose only cost should be
reading its weight once at the memory's bandwidth; torch's `F.linear` at M=1 reads a [N, K] weight at
well under that on the CPUs measured (`python -m bench.small_linear` measures both). csrc/small_linear.cpp
does it on the weight as stored, so no second, transposed copy of any weight exists. This module
owns the choice (float32 on the CPU, at most MAX_ROWS rows, a contiguous weight, no autograd) and the
call; it must not hold weights nor build anything (native.py does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.worker.model import native

# Above this many rows torch's blocked GEMM wins on SmolLM2's shapes (bench/small_linear.py measures it).
MAX_ROWS = 8


def small_batch(x: Tensor) -> bool:
    """Whether x is what the native small-batch kernels take: [M, K] float32 on the CPU, 0 < M <=
    MAX_ROWS, outside autograd (small_int8.py asks the same of its input)."""
    return (
        x.device.type == "cpu"
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dim() == 2
        and x.dtype == torch.float32
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def _applies(x: Tensor, weight: Tensor) -> bool:
    return (
        small_batch(x)
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and not (torch.is_grad_enabled() and weight.requires_grad)
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]^T + bias: the native kernel for M <= MAX_ROWS on the CPU in float32."""
    kernels = native.library() if _applies(x, weight) else None
    if kernels is None:
        return F.linear(x, weight, bias)
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    # Held in a name so a contiguous copy outlives the call that reads it.
    dense_bias = bias.contiguous() if bias is not None else None
    bias_ptr = dense_bias.data_ptr() if dense_bias is not None else None
    kernels.small_linear(
        x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1]
    )
    return out


def project(module: nn.Module, x: Tensor) -> Tensor:
    """Apply a projection: plain nn.Linear layers through `linear`, any other (quantized) module itself."""
    if type(module) is nn.Linear:
        return linear(x, module.weight, module.bias)
    result: Tensor = module(x)
    return result
