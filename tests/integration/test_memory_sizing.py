"""The engine sizes its KV cache from a real measurement, and the worker shows the budget.

Tiny random-weight models, the real profiling step and the real limit reader: where a test needs a
given limit, the reader is pointed at a copy of the cgroup files whose memory.max is set relative to
this process's own resident memory now (the only figure a test can hold a cache size against on a
shared machine). They prove: the profiling peak is measured (memory a forward pass takes on purpose
shows up in it); the cache is the smaller ceiling's budget less that peak; a budget too small and an
explicit size that cannot fit refuse to start with the numbers; the budget reaches the log, the
metrics and ListModels.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc
import psutil
import pytest
import torch
from prometheus_client import REGISTRY

from services.worker.engine import memory_profile
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.memory_budget import MOST_USEFUL, MemoryBudgetError
from services.worker.memory_limit import cpu_limit
from services.worker.model.loader import load_model
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.cgroup_files import fake_cgroups
from tests.integration.tiny_stack import tiny_stack

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.memory_limit import MemoryLimit

MIB = 2**20
BALLAST = 96 * MIB


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _limit_at(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cgroup_bytes: int, available: int | None = None
) -> None:
    """Make the engine's limit the real reader over a pod cgroup copy with memory.max=cgroup_bytes."""
    files = fake_cgroups(
        tmp_path, "v2", "/pod", {"/pod": {"memory.max": str(cgroup_bytes), "memory.current": "0"}}
    )

    def limit(device: str) -> MemoryLimit:
        return cpu_limit(files, available=available)

    monkeypatch.setattr(memory_profile, "memory_limit", limit)


def test_the_profiling_peak_is_measured_not_assumed(tiny_llama_dir: Path) -> None:
    """A forward pass that touches 96 MiB more on purpose raises the measured activation peak to at
    least that much: the figure comes from the process's memory, not from a formula of the settings."""
    loaded = load_model(tiny_llama_dir)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64)
    plain = memory_profile.profile_largest_step(loaded, config, 256)

    def ballast(*_: object) -> None:
        torch.ones(BALLAST // 4)  # freed when the hook returns: only the high-water mark keeps it

    handle = loaded.model.layers[0].register_forward_hook(ballast)
    try:
        heavy = memory_profile.profile_largest_step(loaded, config, 256)
    finally:
        handle.remove()
    assert plain.method == "VmHWM (reset by clear_refs)"
    assert plain.peak_bytes > plain.baseline_bytes > plain.weights_bytes > 0
    # The ballast is live at once with only part of the step's own buffers (it is freed before the
    # next layer), so the heavy peak holds all of it but need not add the plain step's on top; a
    # formula of the settings would give both profiles one figure.
    assert heavy.activation_bytes > BALLAST * 0.9
    assert heavy.activation_bytes > plain.activation_bytes
    assert plain.step == "64 prefill tokens + 8 decodes at 256 tokens of context"


def test_freed_memory_left_resident_does_not_hide_the_step(tiny_llama_dir: Path) -> None:
    """128 MiB allocated in small pieces and freed stays resident in the allocator's heap (as a long
    session leaves it); the tiny model's step, a few MiB, still reads as a peak above the baseline,
    because the profile hands that free heap back before it measures."""
    loaded = load_model(tiny_llama_dir)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64)
    churn = [torch.ones(16 * 1024) for _ in range(2048)]  # 64 KiB each: below malloc's mmap threshold
    del churn
    profile = memory_profile.profile_largest_step(loaded, config, 256)
    assert profile.activation_bytes > 0


def test_the_cache_is_sized_from_the_smaller_of_available_memory_and_the_limit(
    tiny_long_serving_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A pod limit 160 MiB above this process's memory, with far more available, sizes the cache to that
    limit less the measured peak; then less available than the limit sizes it to what is available."""
    config = EngineConfig(max_num_seqs=64, memory_utilization=1.0)
    _limit_at(monkeypatch, tmp_path / "pod", _rss() + 160 * MIB, available=64 * 2**30)
    engine = LLMEngine.from_model_dir(tiny_long_serving_dir, config)
    memory = engine.memory
    assert memory.limit.source == "cgroup v2 memory.max of /pod"
    assert memory.num_blocks == (memory.budget_bytes - memory.profile.peak_bytes) // memory.bytes_per_block
    assert engine.block_manager.num_blocks == memory.num_blocks
    assert memory.num_blocks < 64 * 4096 // 16, "the limit bound the cache, not the running sequences"
    del engine

    _limit_at(monkeypatch, tmp_path / "host", 64 * 2**30, available=160 * MIB)
    engine = LLMEngine.from_model_dir(tiny_long_serving_dir, config)
    assert engine.memory.limit.source == "machine available memory"
    assert (
        engine.memory.num_blocks
        == (engine.memory.budget_bytes - engine.memory.profile.peak_bytes) // engine.memory.bytes_per_block
    )


def test_a_budget_too_small_refuses_to_start_with_the_numbers(
    tiny_long_serving_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A limit barely above this process's memory leaves no room for one 4096-token request."""
    _limit_at(monkeypatch, tmp_path, _rss() + MIB)
    with pytest.raises(MemoryBudgetError) as error:
        LLMEngine.from_model_dir(tiny_long_serving_dir, EngineConfig())
    message = str(error.value)
    assert "the memory budget leaves 0 KV blocks (0 tokens)" in message
    assert "max_model_len=4096 tokens needs 256 blocks" in message
    assert "cgroup v2 memory.max of /pod" in message and "activation peak of" in message


def test_an_explicit_size_that_does_not_fit_is_refused(
    tiny_long_serving_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """num_blocks=200000 (2.3 GiB of this model's 12 KiB blocks) against a limit 64 MiB above now."""
    _limit_at(monkeypatch, tmp_path, _rss() + 64 * MIB)
    with pytest.raises(MemoryBudgetError) as error:
        LLMEngine.from_model_dir(tiny_long_serving_dir, EngineConfig(num_blocks=200_000))
    message = str(error.value)
    assert "engine.num_blocks=200000 asks for a KV cache of 200000 blocks (2.29 GiB)" in message
    assert "STRATA_WORKER_ENGINE__NUM_BLOCKS to at most" in message


def test_the_budget_appears_in_the_log_the_metrics_and_list_models(
    tiny_serving_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker sized by default (nothing pinned) logs its budget, sets the gauges, and the gateway's
    ListModels carries the same figures; the KV capacity is the cache's tokens."""

    async def main() -> tuple[gateway_pb2.ListModelsResponse, int]:
        async with tiny_stack(tiny_serving_dir) as stack:
            tokens = stack.worker.host.engine.engine.memory.kv_tokens
            async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                return await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10), tokens

    with caplog.at_level(logging.INFO, logger="services.worker.host"):
        reply, kv_tokens = asyncio.run(main())
    (model,) = reply.models
    memory = model.memory
    assert model.kv_cache_tokens == memory.kv_tokens == kv_tokens > 0
    # 64 sequences of the tiny model's 256 tokens need far less than the budget: that is its size.
    assert memory.sized_by == MOST_USEFUL and memory.memory_utilization == pytest.approx(0.8)
    assert memory.kv_tokens == 64 * 256
    assert memory.limit_bytes > memory.budget_bytes > memory.kv_cache_bytes > 0
    assert memory.weights_bytes > 0 and memory.activation_peak_bytes > 0
    assert memory.largest_context == model.max_model_len == 256
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: limit")]
    assert lines and f"{memory.kv_blocks} blocks = {memory.kv_tokens} tokens" in lines[-1]
    assert memory.limit_source in lines[-1]
    for part, value in (
        ("limit", memory.limit_bytes),
        ("budget", memory.budget_bytes),
        ("weights", memory.weights_bytes),
        ("activations", memory.activation_peak_bytes),
        ("kv_cache", memory.kv_cache_bytes),
    ):
        assert (
            REGISTRY.get_sample_value("strata_memory_budget_bytes", {"model": "tiny", "part": part}) == value
        )


def test_a_worker_with_an_int8_cache_reports_its_format_and_serves(tiny_serving_dir: Path) -> None:
    """engine.kv_cache_dtype=int8 reaches GetWorkerInfo and ListModels, and a request through the
    gateway decodes over the int8 cache to its length."""

    async def main() -> tuple[gateway_pb2.ListModelsResponse, gateway_pb2.GenerateResponse]:
        async with tiny_stack(tiny_serving_dir, worker={"engine": {"kv_cache_dtype": "int8"}}) as stack:
            assert stack.worker.host.engine.engine.runner.cache.keys[0].dtype == torch.int8
            async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                listed = await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
                request = gateway_pb2.GenerateRequest(
                    prompt="hello there",
                    sampling=common_pb2.SamplingParams(max_new_tokens=24, ignore_eos=True),
                )
                return listed, await stub.Generate(request, timeout=60)

    listed, reply = asyncio.run(main())
    (model,) = listed.models
    assert model.memory.kv_cache_dtype == "int8"
    assert reply.usage.output_tokens == 24
