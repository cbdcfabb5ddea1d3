"""Measure the largest engine step before the KV cache is allocated, and size the cache from it.

The step is the most the settings allow at once: a prefill chunk of max_num_batched_tokens tokens and
max_num_seqs decodes, every one at max_model_len tokens of context, with the costliest sampling path.
It runs through the real ModelRunner over a one-block scratch cache (every block table points at that
block), so the attention's gathers, the logits and the sampler take their full size while the cache
itself costs nothing. The peak is read, not assumed: on the CPU the kernel's resident-set high-water
mark (VmHWM, reset first through /proc/self/clear_refs), on CUDA torch's peak allocation, plus the
CUDA graphs' memory where graphs are captured (every bucket the settings reach). This module must not
decide the cache's size (memory_budget.py does) nor keep anything it allocated for the step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.worker.device_memory import device_memory_bytes
from services.worker.engine.model_runner import ModelRunner
from services.worker.engine.sequence import ScheduledBatch, ScheduledEntry, Sequence
from services.worker.memory_budget import CacheRequest, MemoryBudget, MemoryProfile, plan
from services.worker.memory_limit import MemoryLimit, memory_limit
from services.worker.model import kv_format
from services.worker.model.kv_cache import KVCache
from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from services.worker.engine.config import EngineConfig
    from services.worker.model.loader import LoadedModel

log = logging.getLogger(__name__)

PROC_SELF = Path("/proc/self")
# Sampling that takes every branch of the sampler (temperature, top-k, top-p, the penalties' history).
_COSTLIEST = SamplingParams(
    max_new_tokens=1, temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, no_repeat_ngram_size=3
)


def size_kv_cache(
    loaded: LoadedModel,
    config: EngineConfig,
    max_model_len: int,
    limit: Callable[[str], MemoryLimit] | None = None,
    draft: LoadedModel | None = None,
    adapters_bytes: int = 0,
) -> MemoryBudget:
    """Profile the largest step, then plan the KV cache within `limit(device)` (memory_limit's by
    default); raises MemoryBudgetError. With a draft model (loaded already, so in the measured
    baseline), its weights count as weights and a block is one of each cache's: both hold as many
    tokens. adapters_bytes: the LoRA adapter slots' memory (allocated already), weights too."""
    profile = profile_largest_step(loaded, config, max_model_len)
    extra = adapters_bytes + (weights_bytes(draft.model) if draft is not None else 0)
    if extra:
        profile = replace(profile, weights_bytes=profile.weights_bytes + extra)
    request = CacheRequest(
        block_size=config.block_size,
        bytes_per_block=bytes_per_block(loaded, config, draft),
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        memory_utilization=config.memory_utilization,
        num_blocks=config.num_blocks,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        kv_cache_dtype=kv_format.resolve(config.kv_cache_dtype, loaded.dtype, loaded.device).name,
    )
    # Measured after loading and profiling: what others took meanwhile is no longer available.
    found = (memory_limit if limit is None else limit)(str(loaded.device))
    return plan(found, profile, request)


def explicit_num_blocks(
    loaded: LoadedModel, config: EngineConfig, draft: LoadedModel | None = None
) -> int | None:
    """The blocks an explicit num_blocks or kv_cache_memory_bytes asks for; None when memory sizes it."""
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_memory_bytes is None:
        return None
    return config.kv_cache_memory_bytes // bytes_per_block(loaded, config, draft)


def bytes_per_block(loaded: LoadedModel, config: EngineConfig, draft: LoadedModel | None = None) -> int:
    """One block of the KV cache in the configured format, and of the draft model's (its own dtype)."""
    fmt = kv_format.resolve(config.kv_cache_dtype, loaded.dtype, loaded.device)
    size = KVCache.bytes_per_block(loaded.config, config.block_size, fmt)
    if draft is not None:
        own = kv_format.resolve("auto", draft.dtype, draft.device)
        size += KVCache.bytes_per_block(draft.config, config.block_size, own)
    return size


def profile_largest_step(loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> MemoryProfile:
    """Run the largest step once on a scratch cache and return the process's memory around it."""
    device = torch.device(loaded.device)
    step = largest_step(config, max_model_len)
    description = (
        f"{step.entries[-1].num_tokens} prefill tokens + {step.num_decodes} decodes at "
        f"{max_model_len} tokens of context"
    )
    weights = weights_bytes(loaded.model)
    use_graphs = config.cuda_graphs and device.type == "cuda"
    if device.type == "cuda":
        baseline, peak = _cuda_peak(loaded, config, step, max_model_len, use_graphs)
        method = "torch.cuda.max_memory_allocated" + (" plus the CUDA graphs' memory" if use_graphs else "")
    else:
        method, baseline, peak = _cpu_peak(lambda: _run(loaded, config, step, graphs=False))
    return MemoryProfile(weights, baseline, peak, method, description)


def largest_step(config: EngineConfig, max_model_len: int) -> ScheduledBatch:
    """max_num_seqs decodes then one prefill chunk, each at max_model_len tokens of context, whose
    block tables all point at block 0 of a one-block scratch cache."""
    blocks = -(-max_model_len // config.block_size)
    batch = ScheduledBatch(step_id=0)
    for index in range(config.max_num_seqs):
        seq = _sequence(f"profile-decode-{index}", max_model_len, blocks)
        batch.entries.append(ScheduledEntry(seq, max_model_len - 1, 1, [1], sample=True))
    batch.num_decodes = config.max_num_seqs
    chunk = min(config.max_num_batched_tokens, max_model_len)
    seq = _sequence("profile-prefill", max_model_len, blocks)
    batch.entries.append(ScheduledEntry(seq, max_model_len - chunk, chunk, [1] * chunk, sample=True))
    return batch


def _sequence(request_id: str, length: int, blocks: int) -> Sequence:
    seq = Sequence(request_id, [1] * length, _COSTLIEST, seed=0)
    seq.block_table = [0] * blocks
    return seq


def _run(loaded: LoadedModel, config: EngineConfig, step: ScheduledBatch, *, graphs: bool) -> None:
    runner = ModelRunner(
        loaded, 1, config.block_size, use_cuda_graphs=graphs, kv_cache_dtype=config.kv_cache_dtype
    )
    runner.run(step)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor in the model's state, each once: quantized modules keep theirs packed in
    tuples, and a tied vocabulary projection's state names the embedding's own tensor again."""
    seen: set[int] = set()
    return sum(_tensor_bytes(value, seen) for value in model.state_dict().values())


def _tensor_bytes(value: object, seen: set[int]) -> int:
    if isinstance(value, torch.Tensor):
        if value.data_ptr() in seen:
            return 0
        seen.add(value.data_ptr())
        return value.numel() * value.element_size()
    if isinstance(value, tuple | list):
        return sum(_tensor_bytes(item, seen) for item in value)
    return 0


def _cpu_peak(run: Callable[[], None], proc_self: Path = PROC_SELF) -> tuple[str, int, int]:
    """(method, resident bytes before, resident high-water mark during) around `run()`."""
    gc.collect()
    _release_free_heap()
    try:
        # "5" resets VmHWM to the current resident set (Linux 4.0+), so the mark is this step's alone.
        (proc_self / "clear_refs").write_text("5")
        method = "VmHWM (reset by clear_refs)"
    except OSError as error:
        # Without the reset the mark is the process's peak since it started: never below the step's.
        log.warning("cannot reset the resident-set high-water mark (%s): the peak includes loading", error)
        method = "VmHWM since the process started"
    baseline = device_memory_bytes("cpu")
    run()
    gc.collect()
    return method, baseline, max(baseline, read_vm_hwm(proc_self))


def _release_free_heap() -> None:
    """Hand the allocator's free pages back to the kernel (glibc's malloc_trim, every arena), so the
    step's allocations raise the resident set: freed memory that stayed resident from earlier work
    would otherwise hold the step and read as a zero peak, its bytes counted as runtime instead."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "malloc_trim"):
        log.warning("no glibc malloc_trim: freed heap kept resident may hide part of the step's peak")
        return
    libc.malloc_trim(0)


def read_vm_hwm(proc_self: Path = PROC_SELF) -> int:
    """The process's resident-set high-water mark in bytes, from /proc/self/status."""
    for line in (proc_self / "status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{proc_self / 'status'} has no VmHWM line: not a Linux /proc")


def _cuda_peak(
    loaded: LoadedModel, config: EngineConfig, step: ScheduledBatch, max_model_len: int, use_graphs: bool
) -> tuple[int, int]:
    """(bytes before, peak bytes) on the model's GPU: torch's allocations plus what torch does not
    see (the CUDA context, library workspaces), plus the CUDA graphs' memory."""
    device = torch.device(loaded.device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    _run(loaded, config, step, graphs=False)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    graphs = _graph_pool_bytes(loaded, config, max_model_len) if use_graphs else 0
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    return before + outside_torch, peak + graphs + outside_torch


def _graph_pool_bytes(loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> int:
    """Memory the CUDA graphs of every bucket the settings reach hold: captured by a runner over a
    scratch cache, as the engine's own runner captures them at warm-up, then freed."""
    device = torch.device(loaded.device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    runner = ModelRunner(
        loaded,
        1,
        config.block_size,
        use_cuda_graphs=True,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        kv_cache_dtype=config.kv_cache_dtype,
    )
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_reserved(device) - before
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return max(0, held)
