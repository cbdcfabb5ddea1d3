"""On a CUDA device: the KV cache is sized from the GPU's memory and a measured peak.

Without a CUDA device (CI has none) these tests are reported as skipped, with the reason
(tests/gpu/conftest.py); bench/gpu.sh runs them on a machine with a GPU and records the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graphs", [False, True])
def test_the_cache_is_the_gpu_budget_less_the_measured_peak(tiny_llama_dir: Path, graphs: bool) -> None:
    """The limit is the device's, the peak comes from torch's allocator (plus the graphs' memory
    when graphs are on), and the cache is the budget less that peak, capped by the running slots."""
    config = EngineConfig(max_num_seqs=256, memory_utilization=0.05, cuda_graphs=graphs)
    engine = LLMEngine.from_model_dir(tiny_llama_dir, config, device="cuda", dtype=torch.float32)
    memory = engine.memory
    assert memory.limit.source.startswith("cuda:0")
    assert memory.profile.method.startswith("torch.cuda.max_memory_allocated")
    assert memory.profile.peak_bytes > memory.profile.baseline_bytes
    room = (memory.budget_bytes - memory.profile.peak_bytes) // memory.bytes_per_block
    assert memory.num_blocks == min(room, 256 * -(-engine.max_model_len // config.block_size))
    assert engine.runner.cache.nbytes() >= memory.kv_cache_bytes
