"""On a CUDA device: graphs are captured at warm-up, and decode steps replayed from them agree with
eager steps and with transformers under the parity rule.

Without a CUDA device (CI has none) these tests are reported as skipped, with the reason
(tests/gpu/conftest.py); bench/gpu.sh runs them on a machine with a GPU and records the result.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.worker.engine.config import EngineConfig
from services.worker.engine.cuda_graphs import CudaGraphRunner
from services.worker.engine.engine import LLMEngine
from strata.sampling import SamplingParams
from tests.parity import assert_greedy_parity, hf_greedy_reference

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


def _engine(model_dir: Path, graphs: bool, max_model_len: int | None = None) -> LLMEngine:
    config = EngineConfig(
        num_blocks=512, block_size=16, cuda_graphs=graphs, max_num_seqs=48, max_model_len=max_model_len
    )
    return LLMEngine.from_model_dir(model_dir, config, device="cuda", dtype=torch.float32)


def test_graphs_are_captured_before_any_request(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, True, max_model_len=256)
    graphs, report = engine.runner.graphs, engine.runner.graph_capture
    assert graphs is not None and report is not None
    batches, blocks = graphs.buckets(48, 256)
    assert batches[-1] == 48 and blocks[-1] == 16
    assert report.graphs == graphs.num_graphs == len(batches) * len(blocks)
    assert report.seconds > 0 and report.memory_bytes >= 0 and report.dropped_batches == ()
    engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert graphs.num_graphs == report.graphs, "a serving step captured a graph"
    assert graphs.replays == 7


def test_graph_and_eager_decode_both_match_transformers(tiny_llama_dir: Path) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 384) for _ in range(rng.randint(1, 70))] for _ in range(37)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    eager = _engine(tiny_llama_dir, False).generate(prompts, params)
    graphed_engine = _engine(tiny_llama_dir, True)
    graphed = graphed_engine.generate(prompts, params)
    assert graphed_engine.runner.graphs is not None and graphed_engine.runner.graphs.replays > 0
    hf: Any = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    hf = hf.to("cuda")
    for index, prompt in enumerate(prompts):
        ref, logits = hf_greedy_reference(hf, prompt, NEW_TOKENS)
        assert_greedy_parity(eager[index], ref, logits, context=f"eager prompt {index}")
        assert_greedy_parity(graphed[index], ref, logits, context=f"graphed prompt {index}")


def test_out_of_memory_capture_drops_the_largest_batches(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    capture = CudaGraphRunner._capture

    def starved(self: CudaGraphRunner, batch: int, blocks: int) -> object:
        if batch >= 32:
            raise torch.OutOfMemoryError("simulated: no room for this graph")
        return capture(self, batch, blocks)

    monkeypatch.setattr(CudaGraphRunner, "_capture", starved)
    engine = _engine(tiny_llama_dir, True, max_model_len=256)
    report = engine.runner.graph_capture
    assert report is not None and report.dropped_batches == (32, 48)
    assert report.largest_batch == 24
    outputs = engine.generate([[3, 4, 5]] * 40, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert all(len(out) == 4 for out in outputs)  # 40 decodes run eagerly, 1-24 from graphs


def test_graph_hidden_states_match_eager_within_tolerance(tiny_llama_dir: Path) -> None:
    from services.worker.model.attention import AttentionMetadata
    from services.worker.model.kv_cache import KVCache
    from services.worker.model.loader import load_model

    loaded = load_model(tiny_llama_dir, device="cuda", dtype=torch.float32)
    cache = KVCache.allocate(loaded.config, 65, 16, torch.float32, torch.device("cuda"))
    runner = CudaGraphRunner(loaded.model, cache, 16, torch.device("cuda"), pad_block=64)
    runner.capture_all(max_num_seqs=4, max_model_len=64)
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
