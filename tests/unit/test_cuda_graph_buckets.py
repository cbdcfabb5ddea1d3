"""Which CUDA-graph buckets the warm-up captures for an engine's settings (arithmetic only: the
capture itself needs a GPU and is tested in tests/gpu)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.worker.engine.cuda_graphs import BATCH_BUCKETS, CudaGraphRunner
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import load_model

if TYPE_CHECKING:
    from pathlib import Path


def _runner(model_dir: Path) -> CudaGraphRunner:
    loaded = load_model(model_dir)
    cache = KVCache.allocate(loaded.config, 8, 16, torch.float32, "cpu")
    return CudaGraphRunner(loaded.model, cache, 16, torch.device("cpu"), pad_block=7)


def test_buckets_reach_max_num_seqs_and_max_model_len(tiny_llama_dir: Path) -> None:
    batches, blocks = _runner(tiny_llama_dir).buckets(max_num_seqs=48, max_model_len=256)
    assert batches == [1, 2, 4, 8, 16, 24, 32, 48]
    assert blocks == [4, 8, 16]  # 256 tokens are 16 blocks of 16


def test_buckets_round_up_and_stop_at_the_model_and_the_largest_bucket(tiny_llama_dir: Path) -> None:
    runner = _runner(tiny_llama_dir)
    batches, blocks = runner.buckets(max_num_seqs=50, max_model_len=100)
    assert batches[-1] == 64  # 50 running sequences pad up to the 64 bucket
    assert blocks == [4, 8]  # 100 tokens are 7 blocks, padded to 8
    batches, blocks = runner.buckets(max_num_seqs=10_000, max_model_len=10**6)
    assert batches == list(BATCH_BUCKETS)
    assert blocks == [4, 8, 16]  # the tiny model's 256 positions, whatever max_model_len says
