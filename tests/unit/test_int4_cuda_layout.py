"""The values, scales and zeros the CUDA int4 kernel is given (int4_cuda.py), checked on the CPU.

`int4_values` turns Q4_0/Q4_1 blocks (an AWQ/GPTQ checkpoint's, repacked by int4_checkpoint.py) into
4-bit values with a scale and zero per group, weight = (q - 8) * scale + zero: those must stand for
exactly the blocks' dequantization, with the checkpoint's own group size found from its scales. Then
torch's CPU build of the same tinygemm kernel family (`_weight_int4pack_mm_for_cpu`, which reads the
same scales-and-zeros layout as the CUDA kernel) multiplies by them as dequantize-then-matmul does.
What this machine cannot run is the CUDA kernel itself and its nibble packing:
tests/gpu/test_int4_cuda.py holds those to the same reference on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from services.worker.model.gguf_weight import GgufPart, GgufWeight
from services.worker.model.int4_checkpoint import int4_scheme, int4_weight
from services.worker.model.int4_cuda import int4_values, servable
from tests.gguf_blocks import random_blocks
from tests.int4_files import Int4Layout, quantization_config, quantize

LAYOUTS = {
    "awq-g128": Int4Layout("awq", 128),
    "awq-g32": Int4Layout("awq", 32),
    "gptq-g64-symmetric": Int4Layout("gptq", 64, symmetric=True),
    "gptq-g128-act-order": Int4Layout("gptq", 128, act_order=True),
    "gptq-per-row": Int4Layout("gptq", -1),
}
# A group of one whole row of 256 columns is the kernel's largest group.
EXPECTED_GROUP = {"awq-g128": 128, "awq-g32": 32, "gptq-g64-symmetric": 64, "gptq-g128-act-order": 128}


def _part(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> GgufPart:
    return GgufPart(qtype, torch.from_numpy(random_blocks(qtype, rows, cols, seed)))


def _checkpoint_weight(name: str, rows: int = 96, cols: int = 256) -> GgufWeight:
    layout = LAYOUTS[name]
    torch.manual_seed(4)
    order = torch.randperm(cols) if layout.act_order else None
    tensors = quantize(torch.randn(rows, cols), layout, order).tensors
    scheme = int4_scheme({"quantization_config": quantization_config(layout)})
    assert scheme is not None
    return int4_weight(scheme, tensors, "w")


def _weight(values: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """(q - 8) * scale + zero, [rows, cols] float32, the columns in the values' order."""
    scale, zero = (scales_and_zeros[..., i].T.repeat_interleave(group_size, dim=1) for i in (0, 1))
    return (values.to(torch.float32) - 8) * scale + zero


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_values_stand_for_the_checkpoint_blocks_in_its_own_groups(name: str) -> None:
    weight = _checkpoint_weight(name)
    assert servable(weight)
    int4 = int4_values(weight)
    assert int4.group_size == EXPECTED_GROUP.get(name, 256)
    assert int4.values.dtype == torch.uint8 and int(int4.values.max()) <= 15
    blocks = GgufWeight(weight.parts).dequantize()  # the blocks' own column order
    got = _weight(int4.values, int4.scales_and_zeros, int4.group_size)
    # m + 8d is summed in float32 where the block's value is d * q + m: a rounding of float32, no more.
    torch.testing.assert_close(got, blocks, rtol=0, atol=1e-6 * float(blocks.abs().max()))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_a_gguf_q4_weight_of_two_parts_is_its_dequantization(qtype: GGMLQuantizationType) -> None:
    weight = GgufWeight([_part(qtype, 16, 128, seed=5), _part(qtype, 8, 128, seed=6)])
    int4 = int4_values(weight)
    assert int4.group_size == 32  # every block of a GGUF file has its own scale
    expected = weight.dequantize()
    got = _weight(int4.values, int4.scales_and_zeros, int4.group_size)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 * float(expected.abs().max()))


def test_rows_not_in_tiles_of_eight_or_other_types_are_not_the_kernels() -> None:
    q4 = GGMLQuantizationType.Q4_1
    assert servable(GgufWeight([_part(q4, 8, 64), _part(GGMLQuantizationType.Q4_0, 8, 64)]))
    assert not servable(GgufWeight([_part(GGMLQuantizationType.Q8_0, 8, 64)]))
    assert not servable(GgufWeight([_part(q4, 8, 64), _part(GGMLQuantizationType.Q5_0, 8, 64)]))
    assert not servable(GgufWeight([_part(q4, 12, 64)]))


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("name", ["awq-g128", "gptq-g64-symmetric", "gptq-per-row"])
def test_the_torch_int4_kernel_family_reads_the_layout_as_meant(name: str, rows: int) -> None:
    int4 = int4_values(_checkpoint_weight(name))
    # The kernel reads scales and zeros in bfloat16: the reference rounds them the same way.
    rounded = int4.scales_and_zeros.to(torch.bfloat16).to(torch.float32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4.values.to(torch.int32), 2)
    x = torch.randn(rows, int4.values.shape[1])
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, int4.group_size, rounded)
    expected = x @ _weight(int4.values, rounded, int4.group_size).T
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * float(expected.abs().max()))
