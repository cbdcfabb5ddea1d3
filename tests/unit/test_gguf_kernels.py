"""The GGUF kernels (csrc/gguf_linear.cpp, gguf_dots.h, gguf_blocks.h) against the gguf package,
an exact reference and the float kernel.

Dequantization must equal the gguf package's bit for bit on every type. Up to eight rows a projection
computed from the blocks must be the exact product of the 8-bit activations with the dequantized
weight within float32 rounding, and the same bits on every instruction set; with AVX-512 VNNI, Q4_0,
Q5_0, Q8_0 and the K types stay on that integer path at any number of rows (the tiled kernels,
gguf_gemm512.h and gguf_kgemm512.h), each row the bits it gets alone; Q4_1 and Q5_1, and every type
without VNNI, take the float32 kernel on the dequantized weight bit for bit from nine to NATIVE_MAX_ROWS rows,
and torch's product within float32 rounding at larger batches. On each path a row's result does not
depend on its batch. test_native_kernels.py reruns this file on AVX2 and portable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.nn.functional as F

from services.worker.model import native
from services.worker.model.gguf_linear import (
    NATIVE_MAX_ROWS,
    GgufEmbedding,
    GgufLinear,
    set_integer_activations,
    supported,
)
from services.worker.model.gguf_weight import GgufWeight
from tests.gguf_blocks import SERVED_TYPES, T, activation_block, gguf_weight, quantized_activations, reference

INTEGER_MAX_ROWS = 8  # csrc/gguf_linear.cpp's kIntegerMaxRows

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


def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).abs().max() / exact.abs().max())


@pytest.mark.parametrize("qtype", SERVED_TYPES, ids=lambda t: t.name)
def test_up_to_eight_rows_the_projection_is_the_exact_product_of_8_bit_activations(qtype: T) -> None:
    weight = gguf_weight(qtype, rows=37, cols=512, seed=1)
    bias = torch.randn(37)
    module = GgufLinear(weight, bias)
    dense = reference(weight).double()
    x = torch.randn(INTEGER_MAX_ROWS, 512)
    every_row = module(x)
    for rows in range(1, INTEGER_MAX_ROWS + 1):
        # The same bits in a batch of any size: each row is computed alone.
        assert torch.equal(module(x[:rows]), every_row[:rows])
    rounded = quantized_activations(x, activation_block(qtype))
    on_8_bits = _relative_error(every_row, rounded @ dense.T + bias.double())
    on_float32 = _relative_error(every_row, x.double() @ dense.T + bias.double())
    assert on_8_bits < 1e-5
    # The activations really are rounded to 8 bits: their error dwarfs float32 rounding's.
    assert 1e-3 < on_float32 < 2e-2


def test_a_row_with_an_infinity_gives_nan_and_leaves_the_other_rows_alone() -> None:
    module = GgufLinear(gguf_weight(T.Q8_0, rows=16, cols=256, seed=2))
    x = torch.randn(3, 256)
    alone = module(x)
    x[1, 40] = float("inf")
    got = module(x)
    assert torch.isnan(got[1]).all()
    assert torch.equal(got[0], alone[0]) and torch.equal(got[2], alone[2])


_ON_AN_ISA = """
import sys, torch
from services.worker.model.gguf_linear import GgufLinear
from tests.gguf_blocks import SERVED_TYPES, T, gguf_weight
torch.manual_seed(0)
# Eight rows: one call of the VNNI kernels, two of AVX2's and the portable build's four; five: 4 + 1.
x, odd = torch.randn(8, 512), torch.randn(5, 544)
outs = [GgufLinear(gguf_weight(t, rows=19, cols=512, seed=3))(x[:5]) for t in SERVED_TYPES]
outs += [GgufLinear(gguf_weight(t, rows=19, cols=512, seed=3))(x) for t in SERVED_TYPES]
# 17 blocks a row: the last block of a row of 32-value blocks has no partner.
outs += [GgufLinear(gguf_weight(t, rows=19, cols=544, seed=4))(odd) for t in (T.Q8_0, T.Q4_1, T.Q5_0)]
torch.save(torch.cat(outs), sys.argv[1])
"""


@pytest.mark.skipif("STRATA_NATIVE_ISA" in os.environ, reason="compares this ISA with the portable one")
def test_the_integer_path_gives_the_same_bits_on_every_instruction_set(tmp_path: Path) -> None:
    if native.isa() == "portable":
        pytest.skip("this CPU runs the portable build only: nothing to compare it with")
    root = Path(__file__).parents[2]
    # On an AVX-512 CPU the AVX2 build is compared too (with VNNI, the two-blocks-a-step kernels run here).
    caps = ("", "avx2", "portable") if native.isa() == "avx512" else ("", "portable")
    results = []
    for cap in caps:
        saved = tmp_path / f"{cap or 'native'}.pt"
        env = {**os.environ, **({"STRATA_NATIVE_ISA": cap} if cap else {})}
        subprocess.run([sys.executable, "-c", _ON_AN_ISA, saved], check=True, env=env, cwd=root, timeout=300)
        results.append(torch.load(saved).view(torch.int32))
    for cap, result in zip(caps[1:], results[1:], strict=True):
        assert torch.equal(results[0], result), cap


@pytest.mark.parametrize("qtype", SERVED_TYPES, ids=lambda t: t.name)
def test_from_nine_rows_the_projection_is_the_float_kernel_on_the_dequantized_weight(qtype: T) -> None:
    weight = gguf_weight(qtype, rows=37, cols=256, seed=1)
    bias = torch.randn(37)
    module = GgufLinear(weight, bias)
    if module.any_rows(_kernels()):
        pytest.skip(f"this CPU's tiled integer kernel takes {qtype.name} at every batch size (tested below)")
    dense = reference(weight)
    x = torch.randn(NATIVE_MAX_ROWS, 256)
    every_row = module(x)
    for rows in (INTEGER_MAX_ROWS + 1, 23, NATIVE_MAX_ROWS):
        got = module(x[:rows])
        assert torch.equal(got, _float_kernel(x[:rows], dense, bias))
        assert torch.equal(got, every_row[:rows])
    exact = x.double() @ dense.double().T + bias.double()
    torch.testing.assert_close(every_row.double(), exact, rtol=1e-4, atol=1e-4)


TILED_TYPES = (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)


@pytest.mark.parametrize("qtype", TILED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("odd", [False, True], ids=["even-blocks", "odd-blocks"])
def test_with_vnni_many_rows_stay_on_the_integer_path_each_row_the_bits_it_gets_alone(
    qtype: T, odd: bool
) -> None:
    """The tiled kernel (many panels, so both threads share them) against each row computed alone by
    the decode path's kernel: equal bit for bit at every batch size, the rows of x in fours and the
    last few alone, and the exact product of the 8-bit activations. An odd number of blocks (17 of
    32 values, 3 super-blocks of 256) leaves the last block of a row of 32-value blocks without a
    partner."""
    kernels = _kernels()
    cols = (768 if odd else 512) if activation_block(qtype) == 256 else (544 if odd else 512)
    weight = gguf_weight(qtype, rows=70, cols=cols, seed=7)
    bias = torch.randn(70)
    module = GgufLinear(weight, bias)
    if not module.any_rows(kernels):
        pytest.skip(f"{native.isa()}, no AVX-512 VNNI: {qtype.name} takes the float path above eight rows")
    x = torch.randn(203, cols)
    alone = torch.cat([module(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in (INTEGER_MAX_ROWS + 1, 23, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 203):
        assert torch.equal(module(x[:rows]), alone[:rows]), rows
    rounded = quantized_activations(x, activation_block(qtype))
    assert _relative_error(alone, rounded @ reference(weight).double().T + bias.double()) < 1e-5


def test_switched_to_float_activations_many_rows_take_the_float_path_again() -> None:
    """set_integer_activations(False), the parity checks' switch, turns the tiled kernel off too."""
    kernels = _kernels()
    weight = gguf_weight(T.Q8_0, rows=20, cols=256, seed=8)
    module = GgufLinear(weight)
    x = torch.randn(40, 256)
    previous = set_integer_activations(kernels, False)
    try:
        assert not module.any_rows(kernels)
        got = module(x)
    finally:
        set_integer_activations(kernels, previous)
    assert torch.equal(got, _float_kernel(x, reference(weight), torch.zeros(20)))


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
    x = torch.randn(2, 3, 256)  # the integer path: the exact product of the 8-bit activations
    rows = x.reshape(6, 256)
    exact = (
        torch.cat(
            [
                quantized_activations(rows, activation_block(p.qtypes[0])) @ reference(p).double().T
                for p in parts
            ],
            dim=1,
        )
        + bias.double()
    )
    torch.testing.assert_close(module(x).reshape(6, 96).double(), exact, rtol=1e-5, atol=1e-4)
    tiled = [p.qtypes[0] in TILED_TYPES and GgufLinear(p).any_rows(_kernels()) for p in parts]
    for rows in (8, NATIVE_MAX_ROWS):  # the float kernel, then the dequantize-and-GEMM path (2 x rows)
        x = torch.randn(2, rows, 256)
        got = module(x).reshape(2 * rows, 96)
        flat = x.reshape(2 * rows, 256)
        at = 0
        for part, integer in zip(parts, tiled, strict=True):
            # A tiled type stays on the integer path: the exact product of the 8-bit activations.
            on = quantized_activations(flat, activation_block(part.qtypes[0])) if integer else flat.double()
            exact = on @ reference(part).double().T + bias[at : at + part.shape[0]].double()
            torch.testing.assert_close(got[:, at : at + part.shape[0]].double(), exact, rtol=1e-5, atol=1e-4)
            at += part.shape[0]


def test_above_native_max_rows_a_part_without_a_tiled_kernel_is_dequantized_beside_the_tiled_one() -> None:
    tiled, other = gguf_weight(T.Q8_0, 16, 256, 9), gguf_weight(T.Q4_1, 24, 256, 10)
    module = GgufLinear(cast("GgufWeight", torch.cat(cast("list[torch.Tensor]", [tiled, other]))))
    if not GgufLinear(tiled).any_rows(_kernels()):
        pytest.skip(f"{native.isa()}, no AVX-512 VNNI: no part has a tiled kernel")
    x = torch.randn(NATIVE_MAX_ROWS + 36, 256)
    got = module(x)
    alone = torch.cat([module(x[i : i + 1])[:, :16] for i in range(x.shape[0])])
    assert torch.equal(got[:, :16], alone)  # the integer path, row by row
    torch.testing.assert_close(got[:, 16:], F.linear(x, reference(other)), rtol=1e-5, atol=1e-4)


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
    weight = gguf_weight(T.Q5_1, 8, 256, 6)  # no tiled kernel: the float kernel at 16 rows everywhere
    module = GgufLinear(weight)
    x = torch.randn(16, 256)  # the float kernel's path: switched off, only the summation order differs
    on = module(x)
    previous = native.set_enabled(False)
    try:
        off = module(x)
    finally:
        native.set_enabled(previous)
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)
