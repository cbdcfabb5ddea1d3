"""On a CUDA device: adapter rows through torch's path (one pair of matmuls per slot) give PEFT's merged
model's logits, and the base rows of the same batch the base model's.

Without a CUDA device (CI has none) it is reported as skipped, with the reason
(tests/gpu/conftest.py); bench/gpu.sh runs it on a machine with a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import load_model
from services.worker.model.lora import LoraSlots
from services.worker.model.lora_file import read_adapter
from tests.parity import assert_logits_close

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.gpu


def test_a_mixed_batch_on_cuda_equals_the_merged_and_base_models(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip(
        "peft", reason="PEFT makes the adapter: carry its wheel in .whl/ (bench/gpu.sh installs it)"
    )
    from tests.lora_adapters import base_model, merged_model, write_adapter

    adapter = write_adapter(tiny_llama_dir, tmp_path / "adapter", seed=3)
    cuda = torch.device("cuda")
    ours = load_model(tiny_llama_dir, device="cuda", dtype=torch.float32).model
    slots = LoraSlots(ours.config, 2, 16, cuda, torch.float32)
    slots.install(1, read_adapter("adapter", adapter, ours.config, 16))
    ours.attach_lora(slots)
    ids = torch.randint(0, 384, (9,), generator=torch.Generator().manual_seed(5))
    batch = torch.cat((ids, ids))  # the same prompt twice: through the adapter, then the base
    cache = KVCache.allocate(ours.config, 16, 4, torch.float32, cuda)
    meta = AttentionMetadata.build([9, 9], [9, 9], [[0, 1, 2], [3, 4, 5]], 4, cuda, 0)
    with torch.inference_mode():
        slots.set_rows([1] * 9 + [-1] * 9)
        positions = torch.cat((torch.arange(9), torch.arange(9))).to(cuda)
        logits = ours.compute_logits(ours(batch.to(cuda), positions, meta, cache)).cpu()
        merged = merged_model(tiny_llama_dir, adapter)(ids[None]).logits[0]
        base = base_model(tiny_llama_dir)(ids[None]).logits[0]
    assert_logits_close(logits[:9], merged, atol=1e-3, context="adapter rows on CUDA")
    assert_logits_close(logits[9:], base, atol=1e-3, context="base rows on CUDA")
