"""The worker's memory budget: what the KV cache gets once weights and the largest step are paid for.

Owns the arithmetic: the budget is `memory_utilization` times the limit the worker may use
(memory_limit.py); the measured peak of weights, runtime and activations (the profile of the largest
step, engine/memory_profile.py) comes off it; the KV cache gets the rest in whole blocks, no more than
the running sequences can ever hold. An explicit `num_blocks` or `kv_cache_memory_bytes` wins, unless
it cannot fit the limit at all. Every refusal is a MemoryBudgetError that gives the figures and the
settings to change. This module must not measure anything (its callers hand it the figures) nor
import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.worker.memory_limit import human

if TYPE_CHECKING:
    from services.worker.memory_limit import MemoryLimit

_ENGINE = "STRATA_WORKER_ENGINE__"
MOST_USEFUL = "max_num_seqs x max_model_len"
"""`sized_by` when the budget holds more than every running sequence at full length could use."""


class MemoryBudgetError(ValueError):
    """The KV cache the settings ask for, or the one the budget leaves, cannot serve; the worker stops."""


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """The process's memory around the largest step the settings allow, as measured."""

    weights_bytes: int
    """Bytes of the model's parameters and buffers."""
    baseline_bytes: int
    """The process's memory just before the step: weights, interpreter, libraries, allocator."""
    peak_bytes: int
    """The process's highest memory while the step ran (CUDA graphs' memory included where captured)."""
    method: str
    """How the peak was read, e.g. "VmHWM (reset by clear_refs)" or "torch.cuda.max_memory_allocated"."""
    step: str
    """The step that was run, e.g. "512 prefill tokens + 64 decodes at 8192 tokens of context"."""

    @property
    def runtime_bytes(self) -> int:
        return max(0, self.baseline_bytes - self.weights_bytes)

    @property
    def activation_bytes(self) -> int:
        return max(0, self.peak_bytes - self.baseline_bytes)


@dataclass(frozen=True, slots=True)
class CacheRequest:
    """What the engine's settings ask of the KV cache."""

    block_size: int
    bytes_per_block: int
    max_model_len: int
    max_num_seqs: int
    memory_utilization: float
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "float32"
    """The cache rows' format (kv_format.py's names), which bytes_per_block already counts."""

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request of max_model_len tokens holds."""
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """How the worker's memory is spent; `parts()` are the gauge's and ListModels' figures."""

    limit: MemoryLimit
    memory_utilization: float
    budget_bytes: int
    profile: MemoryProfile
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    sized_by: str
    """"memory_utilization", MOST_USEFUL (the budget holds more), "num_blocks" or
    "kv_cache_memory_bytes"."""
    kv_cache_dtype: str
    """The cache rows' format: float32, bfloat16, int8 (scales included in bytes_per_block), fp8_e4m3."""

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def largest_context(self) -> int:
        """The longest request the cache holds alone: the context limit, or the cache when smaller."""
        return min(self.max_model_len, self.kv_tokens)

    def parts(self) -> dict[str, int]:
        return {
            "limit": self.limit.bytes,
            "budget": self.budget_bytes,
            "weights": self.profile.weights_bytes,
            "runtime": self.profile.runtime_bytes,
            "activations": self.profile.activation_bytes,
            "kv_cache": self.kv_cache_bytes,
        }

    def describe(self) -> str:
        """The start-up log line: where the limit came from and where every byte of the budget goes."""
        p = self.profile
        full = self.kv_tokens // self.max_model_len
        return (
            f"memory: limit {self.limit.describe()}; memory_utilization {self.memory_utilization:g} -> "
            f"budget {human(self.budget_bytes)}: weights {human(p.weights_bytes)}, runtime "
            f"{human(p.runtime_bytes)}, activation peak {human(p.activation_bytes)} (measured by {p.method} "
            f"over {p.step}), KV cache {human(self.kv_cache_bytes)} in {self.kv_cache_dtype} = "
            f"{self.num_blocks} blocks = "
            f"{self.kv_tokens} tokens (sized by {self.sized_by}); largest context that fits "
            f"{self.largest_context} tokens, {full} requests of max_model_len={self.max_model_len} at once"
        )


def plan(limit: MemoryLimit, profile: MemoryProfile, request: CacheRequest) -> MemoryBudget:
    """The KV cache's size in blocks for these figures, or MemoryBudgetError naming the fix."""
    budget = int(request.memory_utilization * limit.bytes)
    per_block = request.bytes_per_block
    if request.num_blocks is not None or request.kv_cache_memory_bytes is not None:
        return _explicit(limit, profile, request, budget)
    # Running sequences never hold more than this; blocks past it would be allocated and never used.
    most_useful = request.max_num_seqs * request.blocks_per_request
    fits = max(0, budget - profile.peak_bytes) // per_block
    blocks = min(most_useful, fits)
    if blocks < request.blocks_per_request:
        raise MemoryBudgetError(_too_small(limit, profile, request, budget, blocks))
    sized_by = "memory_utilization" if fits <= most_useful else MOST_USEFUL
    return MemoryBudget(
        limit, request.memory_utilization, budget, profile, blocks, request.block_size, per_block,
        request.max_model_len, sized_by, request.kv_cache_dtype,
    )  # fmt: skip


def _explicit(limit: MemoryLimit, profile: MemoryProfile, request: CacheRequest, budget: int) -> MemoryBudget:
    per_block = request.bytes_per_block
    if request.num_blocks is not None:
        name, value, blocks = "num_blocks", request.num_blocks, request.num_blocks
    else:
        assert request.kv_cache_memory_bytes is not None
        name, value = "kv_cache_memory_bytes", request.kv_cache_memory_bytes
        blocks = request.kv_cache_memory_bytes // per_block
        if blocks < 1:
            raise MemoryBudgetError(
                f"engine.kv_cache_memory_bytes={value} holds no KV block ({per_block} bytes each for "
                f"this model and block_size={request.block_size}); set {_ENGINE}KV_CACHE_MEMORY_BYTES "
                f"to at least {per_block}, or unset it to size the cache from memory_utilization"
            )
    needed = profile.peak_bytes + blocks * per_block
    if needed > limit.bytes:
        fits = max(0, limit.bytes - profile.peak_bytes) // per_block
        raise MemoryBudgetError(
            f"engine.{name}={value} asks for a KV cache of {blocks} blocks ({human(blocks * per_block)}); "
            f"with the measured peak of weights, runtime and activations ({human(profile.peak_bytes)}: "
            f"{profile.step}) that is {human(needed)}, more than the {limit.describe()} this worker may use. "
            f"Set {_ENGINE}NUM_BLOCKS to at most {fits} (or {_ENGINE}KV_CACHE_MEMORY_BYTES to at most "
            f"{fits * per_block}), unset both to size the cache from memory_utilization, or give the "
            f"worker at least {human(needed)} of memory"
        )
    return MemoryBudget(
        limit, request.memory_utilization, budget, profile, blocks, request.block_size, per_block,
        request.max_model_len, name, request.kv_cache_dtype,
    )  # fmt: skip


def _too_small(
    limit: MemoryLimit, profile: MemoryProfile, request: CacheRequest, budget: int, blocks: int
) -> str:
    need = request.blocks_per_request
    # The limit at which this budget would hold one full-length request.
    wanted = int((profile.peak_bytes + need * request.bytes_per_block) / request.memory_utilization) + 1
    return (
        f"the memory budget leaves {blocks} KV blocks ({blocks * request.block_size} tokens), but one "
        f"request of max_model_len={request.max_model_len} tokens needs {need} blocks "
        f"({human(need * request.bytes_per_block)}): budget {human(budget)} = memory_utilization "
        f"{request.memory_utilization:g} x limit {limit.describe()}, less weights "
        f"{human(profile.weights_bytes)}, runtime {human(profile.runtime_bytes)} and an activation peak of "
        f"{human(profile.activation_bytes)} measured over {profile.step}. Set {_ENGINE}MAX_MODEL_LEN to at "
        f"most {blocks * request.block_size}, lower {_ENGINE}MAX_NUM_SEQS or "
        f"{_ENGINE}MAX_NUM_BATCHED_TOKENS (they size the activation peak), raise "
        f"{_ENGINE}MEMORY_UTILIZATION, or give the worker a memory limit of at least {human(wanted)}"
    )
