"""On a CUDA device: an AWQ checkpoint loads, its projections dequantized at load (no int4 CUDA kernel
is wired in yet), says so in its format and a warning, and runs the model its packed values stand for.

Without a CUDA device (CI has none) this test is reported as skipped, with the reason
(tests/gpu/conftest.py); bench/gpu.sh runs it on a machine with a GPU and records the result.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import pytest
import torch

from services.worker.model.loader import load_model
from tests.conftest import build_tiny_model
from tests.int4_files import Int4Layout, write_int4
from tests.parity import prefill_logits

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.gpu


def test_an_awq_checkpoint_on_cuda_is_the_model_its_values_stand_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = build_tiny_model(tmp_path / "hf", "llama", seed=3, hidden_size=128, intermediate_size=256)
    awq, reference = tmp_path / "awq", tmp_path / "reference"
    write_int4(checkpoint, awq, reference, Int4Layout("awq", 32))
    with caplog.at_level(logging.WARNING):
        ours = load_model(awq, device="cuda", dtype=torch.float32)
    assert ours.weights_format == "AWQ int4 (groups of 32) dequantized to float32: Q4_1 x12"
    assert "dequantized at load" in caplog.text
    theirs = load_model(reference, device="cuda", dtype=torch.float32)
    prompts = [[1, 17, 29, 301, 5], [1, 250, 4]]
    # The one difference: a Q4_1 block's float16 offset, under a thousandth of a quantization step.
    torch.testing.assert_close(
        prefill_logits(ours.model, prompts), prefill_logits(theirs.model, prompts), rtol=1e-3, atol=1e-2
    )
