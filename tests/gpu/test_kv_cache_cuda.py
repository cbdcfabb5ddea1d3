"""On a CUDA device: the fp8_e4m3 and int8 KV caches serve through the engine, CUDA graphs included,
holding more tokens than a bfloat16 cache in the same bytes and mostly agreeing with its greedy tokens.

Without a CUDA device (CI has none) these tests are reported as skipped, with the reason
(tests/gpu/conftest.py); bench/gpu.sh runs them on a machine with a GPU and records the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model.loader import load_model
from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "int8"])
def test_a_quantized_cache_serves_close_to_bfloat16(
    tiny_llama_dir: Path, cache_dtype: str, graphs: bool
) -> None:
    """Same prompts, greedy: the quantized cache's engine runs every request to its length, and its
    tokens equal the bfloat16 cache's on at least half the positions (a random tiny model's near
    ties flip, and a flip changes the rest of that sequence)."""
    loaded = load_model(tiny_llama_dir, device="cuda", dtype=torch.bfloat16)
    engines = {
        name: LLMEngine(
            loaded, EngineConfig(kv_cache_dtype=name, cuda_graphs=graphs, kv_cache_memory_bytes=1 << 26)
        )
        for name in ("bfloat16", cache_dtype)
    }
    assert engines[cache_dtype].memory.kv_tokens > engines["bfloat16"].memory.kv_tokens
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = [[3 + i, 5, 7, 11, 13] * (i + 1) for i in range(6)]
    outputs = {name: e.generate(prompts, params) for name, e in engines.items()}
    assert all(len(tokens) == 24 for tokens in outputs[cache_dtype])
    agree = sum(a == b for x, y in zip(*outputs.values(), strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 0.5 * 6 * 24
