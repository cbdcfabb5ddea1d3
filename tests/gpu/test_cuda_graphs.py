"""On a CUDA device: decode steps replayed from CUDA graphs agree with eager steps.

Without a CUDA device (CI has none) these tests are reported as skipped, with the reason
(tests/gpu/conftest.py); bench/gpu.sh runs them on a machine with a GPU and records the result.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.params import SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.gpu


def _run(model_dir: Path, graphs: bool, prompts: list[list[int]]) -> tuple[list[list[int]], LLMEngine]:
    config = EngineConfig(num_blocks=512, block_size=16, cuda_graphs=graphs)
    engine = LLMEngine.from_model_dir(model_dir, config, device="cuda", dtype=torch.float32)
    return engine.generate(prompts, SamplingParams(max_new_tokens=24)), engine


def test_graph_and_eager_decode_agree(tiny_llama_dir: Path) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 384) for _ in range(rng.randint(1, 70))] for _ in range(37)]
    eager, _ = _run(tiny_llama_dir, False, prompts)
    graphed, engine = _run(tiny_llama_dir, True, prompts)
    assert engine.runner.graphs is not None and engine.runner.graphs.num_graphs > 0
    assert graphed == eager


def test_graph_hidden_states_match_eager_within_tolerance(tiny_llama_dir: Path) -> None:
    from services.worker.engine.cuda_graphs import CudaGraphRunner
    from services.worker.model.attention import AttentionMetadata
    from services.worker.model.kv_cache import KVCache
    from services.worker.model.loader import load_model

    loaded = load_model(tiny_llama_dir, device="cuda", dtype=torch.float32)
    cache = KVCache.allocate(loaded.config, 65, 16, torch.float32, torch.device("cuda"))
    runner = CudaGraphRunner(loaded.model, cache, 16, torch.device("cuda"), pad_block=64)
    tables = [[0, 1, 2], [3, 4], [5]]
    lens = [40, 20, 7]
    with torch.inference_mode():
        for layer in range(cache.num_layers):
            for part in cache.layer(layer):
                part.normal_()
        ids, pos = [5, 6, 7], [n - 1 for n in lens]
        graphed = runner.run_decode(ids, pos, lens, tables)
        assert graphed is not None
        meta = AttentionMetadata.build([1, 1, 1], lens, tables, 16, "cuda", num_decodes=3)
        eager = loaded.model(torch.tensor(ids, device="cuda"), torch.tensor(pos, device="cuda"), meta, cache)
    assert float((graphed - eager).abs().max()) < 1e-4
