"""The GGUF kernels (csrc/gguf_linear.cpp, gguf_blocks.h) against the gguf package and the float kernel.

Dequantization must equal the gguf package's bit for bit on every type; a projection computed from
the blocks must equal the float32 kernel on the dequantized weight bit for bit at every batch of at
most NATIVE_MAX_ROWS rows (so a row's result does not depend on its batch), and torch's product within
float32 rounding at larger batches. test_native_kernels.py reruns this file on AVX2 and portable.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.nn.functional as F

from services.worker.model import native, small_linear
from services.worker.model.gguf_linear import NATIVE_MAX_ROWS, GgufEmbedding, GgufLinear, supported
from services.worker.model.gguf_weight import GgufWeight
from tests.gguf_blocks import SERVED_TYPES, T, gguf_weight, reference

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")


def _kernels() -> native.Library:
    kernels = native.library()
    assert kernels is not None
    return kernels


def _float_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """strata_small_linear, the float32 kernel, at any number of rows."""
    out = torch.empty(x.shape[0], weight.shape[0])
    rows, k = x.shape
    _kernels().small_linear(
        x.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr(), rows, weight.shape[0], k
    )
    return out


@pytest.mark.parametrize("qtype", SERVED_TYPES, ids=lambda t: t.name)
def test_dequantization_equals_the_gguf_package_bit_for_bit(qtype: T) -> None:
    weight = gguf_weight(qtype, rows=24, cols=512, seed=int(qtype))
    part = weight.parts[0]
    out = torch.empty(weight.shape, dtype=torch.float32)
    _kernels().gguf_dequantize(int(qtype), part.data.data_ptr(), out.data_ptr(), *weight.shape)
    expected = reference(weight)
    assert torch.isfinite(expected).all()
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("qtype", SERVED_TYPES, ids=lambda t: t.name)
def test_the_projection_from_blocks_is_the_float_kernel_on_the_dequantized_weight(qtype: T) -> None:
    weight = gguf_weight(qtype, rows=37, cols=256, seed=1)
    bias = torch.randn(37)
    module = GgufLinear(weight, bias)
    dense = reference(weight)
    x = torch.randn(NATIVE_MAX_ROWS, 256)
    every_row = module(x)
    for rows in (*range(1, small_linear.MAX_ROWS + 1), 23, NATIVE_MAX_ROWS):
        got = module(x[:rows])
        assert torch.equal(got, _float_kernel(x[:rows], dense, bias))
        # The same bits in a batch of any size: each row is computed alone.
        assert torch.equal(got, every_row[:rows])
    exact = x.double() @ dense.double().T + bias.double()
    torch.testing.assert_close(every_row.double(), exact, rtol=1e-4, atol=1e-4)


def test_a_fused_weight_of_three_types_with_a_bias_at_small_and_large_batches() -> None:
    q, k, v = (
        gguf_weight(qtype, rows, 256, seed)
        for qtype, rows, seed in ((T.Q4_K, 64, 2), (T.Q6_K, 16, 3), (T.Q8_0, 16, 4))
    )
    parts = [q, k, v]
    # How a family's state dict fuses q, k and v: torch.cat on the tensor-like weights.
    fused = torch.cat(cast("list[torch.Tensor]", parts))
    assert isinstance(fused, GgufWeight)
    assert fused.describe() == "Q4_K+Q6_K+Q8_0" and fused.shape == (96, 256)
    bias = torch.randn(96)
    module = GgufLinear(fused, bias)
    dense = torch.cat([reference(p) for p in parts])
    for rows in (3, NATIVE_MAX_ROWS):  # the kernel, then the dequantize-and-GEMM path (2 x rows)
        x = torch.randn(2, rows, 256)
        torch.testing.assert_close(module(x), F.linear(x, dense, bias), rtol=1e-5, atol=1e-4)


def test_embedding_rows_are_the_dequantized_rows() -> None:
    weight = gguf_weight(T.Q6_K, 50, 256, 5)
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]])
    got = GgufEmbedding(weight)(ids)
    assert got.shape == (2, 3, 256)
    assert torch.equal(got, reference(weight)[ids])


def test_only_types_with_a_kernel_and_whole_blocks_are_supported() -> None:
    kernels = _kernels()
    assert supported(gguf_weight(T.Q4_K, 4, 256), kernels)
    assert not supported(gguf_weight(T.Q2_K, 4, 256), kernels)  # no kernel: the loader dequantizes it
    assert kernels.gguf_supported(int(T.Q4_K), 128) == 0  # half a super-block per row


def test_switched_off_the_module_dequantizes_with_the_gguf_package() -> None:
    weight = gguf_weight(T.Q5_K, 8, 256, 6)
    module = GgufLinear(weight)
    x = torch.randn(2, 256)
    on = module(x)
    previous = native.set_enabled(False)
    try:
        off = module(x)
    finally:
        native.set_enabled(previous)
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)
