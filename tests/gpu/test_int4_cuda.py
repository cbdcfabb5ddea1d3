"""On a CUDA device: AWQ and GPTQ checkpoints run their projections on torch's int4 kernel (tinygemm,
int4_cuda.py) from the 4-bit values, and give the logits of the model their packed values stand for;
in float32, where that kernel does not run, they load dequantized and say so.

Without a CUDA device (CI has none) these tests are reported as skipped, with the reason
(tests/gpu/conftest.py); bench/gpu.sh runs them on a machine with a GPU and records the result.
tests/unit/test_int4_cuda_layout.py checks on the CPU the values, scales and zeros handed to the kernel.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch

from services.worker.engine.memory_profile import weights_bytes
from services.worker.model.int4_cuda import TinygemmLinear
from services.worker.model.loader import load_model
from tests.conftest import build_tiny_model
from tests.int4_files import Int4Layout, write_int4
from tests.parity import prefill_logits

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.model.layers import DecoderLayer

pytestmark = pytest.mark.gpu

SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = [[1, 17, 29, 301, 5], [1, 250, 4], [1, 9, 9, 9, 9, 9, 9, 120]]


def _folders(tmp_path: Path, kind: str, layout: Int4Layout, **overrides: Any) -> tuple[Path, Path]:
    checkpoint = build_tiny_model(tmp_path / "hf", kind, seed=3, **{**SHAPE, **overrides})
    int4, reference = tmp_path / "int4", tmp_path / "reference"
    write_int4(checkpoint, int4, reference, layout)
    return int4, reference


@pytest.mark.parametrize(
    ("kind", "layout", "described"),
    [
        ("llama", Int4Layout("awq", 128), "AWQ int4 (groups of 128) as stored: Q4_1 x12"),
        ("qwen2", Int4Layout("gptq", 32, act_order=True), "GPTQ int4 (groups of 32) as stored: Q4_1 x12"),
    ],
)
def test_int4_projections_run_on_the_int4_kernel_as_the_model_their_values_stand_for(
    tmp_path: Path, kind: str, layout: Int4Layout, described: str
) -> None:
    int4, reference = _folders(tmp_path, kind, layout)
    ours = load_model(int4, device="cuda")  # bfloat16, the default on CUDA
    assert ours.weights_format == described
    layer = cast("DecoderLayer", ours.model.layers[0])
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, TinygemmLinear) and isinstance(layer.mlp.down_proj, TinygemmLinear)
    assert (qkv.input_order is not None) == layout.act_order
    assert qkv.group_size == layout.group_size
    theirs = load_model(reference, device="cuda")
    # Half a byte a weight and a bfloat16 scale and zero per group, where bfloat16 takes two bytes.
    assert weights_bytes(ours.model) < weights_bytes(theirs.model)
    got, expected = prefill_logits(ours.model, PROMPTS), prefill_logits(theirs.model, PROMPTS)
    # Both compute in bfloat16; the kernel's scales and zeros are bfloat16 too (2^-9 of a step).
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-2 * float(expected.abs().max()))
    assert not torch.equal(got, torch.zeros_like(got))


def test_an_awq_checkpoint_in_float32_on_cuda_loads_dequantized_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    int4, reference = _folders(tmp_path, "llama", Int4Layout("awq", 32))
    with caplog.at_level(logging.WARNING):
        ours = load_model(int4, device="cuda", dtype=torch.float32)
    assert ours.weights_format == "AWQ int4 (groups of 32) dequantized to float32: Q4_1 x12"
    assert "dequantized at load" in caplog.text
    theirs = load_model(reference, device="cuda", dtype=torch.float32)
    # The one difference: a Q4_1 block's float16 offset, under a thousandth of a quantization step.
    torch.testing.assert_close(
        prefill_logits(ours.model, PROMPTS), prefill_logits(theirs.model, PROMPTS), rtol=1e-3, atol=1e-2
    )
