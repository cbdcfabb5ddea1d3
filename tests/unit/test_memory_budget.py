"""The budget's arithmetic: what the KV cache gets, and every refusal with its figures and fix.

The figures are round numbers handed in directly (the limit, a measured profile), so each expected
block count can be checked by hand; the measuring itself is tested in test_memory_sizing.py.
"""

from __future__ import annotations

import pytest

from services.worker.memory_budget import MOST_USEFUL, CacheRequest, MemoryBudgetError, MemoryProfile, plan
from services.worker.memory_limit import MemoryLimit

MIB = 2**20
GIB = 2**30
LIMIT = MemoryLimit(10 * GIB, "cgroup v2 memory.max of /pod", (("cgroup v2 memory.max of /pod", 10 * GIB),))
# 1 GiB of weights, 0.5 GiB more before the step, 1.5 GiB above that at the largest step: 3 GiB peak.
PROFILE = MemoryProfile(GIB, GIB + GIB // 2, 3 * GIB, "VmHWM (reset by clear_refs)", "512 + 64 decodes")
REQUEST = CacheRequest(
    block_size=16, bytes_per_block=MIB, max_model_len=8192, max_num_seqs=64, memory_utilization=0.8
)


def test_the_cache_gets_the_budget_less_the_measured_peak_in_whole_blocks() -> None:
    budget = plan(LIMIT, PROFILE, REQUEST)
    assert budget.budget_bytes == int(0.8 * 10 * GIB)
    assert budget.num_blocks == (int(0.8 * 10 * GIB) - 3 * GIB) // MIB  # 5120 blocks of 1 MiB
    assert budget.kv_tokens == budget.num_blocks * 16
    assert budget.largest_context == 8192
    assert budget.sized_by == "memory_utilization"
    assert budget.parts() == {
        "limit": 10 * GIB,
        "budget": int(0.8 * 10 * GIB),
        "weights": GIB,
        "runtime": GIB // 2,
        "activations": GIB + GIB // 2,
        "kv_cache": budget.num_blocks * MIB,
    }
    assert "cgroup v2 memory.max of /pod" in budget.describe()
    assert f"{budget.num_blocks} blocks = {budget.kv_tokens} tokens" in budget.describe()


def test_the_cache_never_outgrows_what_running_sequences_can_hold() -> None:
    """4 sequences of 8192 tokens hold 2048 blocks at most: a larger budget allocates no more."""
    small = CacheRequest(16, MIB, max_model_len=8192, max_num_seqs=4, memory_utilization=0.8)
    planned = plan(LIMIT, PROFILE, small)
    assert planned.num_blocks == 4 * 8192 // 16
    assert planned.sized_by == MOST_USEFUL
    assert "sized by max_num_seqs x max_model_len" in planned.describe()


def test_a_budget_below_one_full_length_request_refuses_with_the_numbers() -> None:
    """5 GiB less a 3 GiB peak leaves 2048 blocks; one 65536-token request needs 4096."""
    long = CacheRequest(16, MIB, max_model_len=65536, max_num_seqs=64, memory_utilization=0.5)
    with pytest.raises(MemoryBudgetError) as error:
        plan(LIMIT, PROFILE, long)
    message = str(error.value)
    assert "leaves 2048 KV blocks (32768 tokens)" in message
    assert "max_model_len=65536 tokens needs 4096 blocks" in message
    assert "STRATA_WORKER_ENGINE__MAX_MODEL_LEN to at most 32768" in message
    assert "STRATA_WORKER_ENGINE__MAX_NUM_SEQS" in message and "MEMORY_UTILIZATION" in message
    # (3 GiB peak + 4 GiB of cache) / 0.5: the limit at which it would start.
    assert "a memory limit of at least 14.00 GiB" in message


def test_an_explicit_size_wins_over_the_budget() -> None:
    """num_blocks above what memory_utilization would give, but within the limit, is kept."""
    budget = plan(LIMIT, PROFILE, CacheRequest(16, MIB, 8192, 64, 0.8, num_blocks=6000))
    assert budget.num_blocks == 6000 and budget.sized_by == "num_blocks"
    budget = plan(LIMIT, PROFILE, CacheRequest(16, MIB, 8192, 64, 0.8, kv_cache_memory_bytes=512 * MIB))
    assert budget.num_blocks == 512 and budget.sized_by == "kv_cache_memory_bytes"


def test_an_explicit_size_that_cannot_fit_the_limit_is_refused() -> None:
    """10 GiB limit less a 3 GiB peak holds 7168 blocks of 1 MiB: 8000 is refused, naming 7168."""
    with pytest.raises(MemoryBudgetError) as error:
        plan(LIMIT, PROFILE, CacheRequest(16, MIB, 8192, 64, 0.8, num_blocks=8000))
    message = str(error.value)
    assert "engine.num_blocks=8000" in message
    assert "STRATA_WORKER_ENGINE__NUM_BLOCKS to at most 7168" in message
    assert "10.00 GiB (cgroup v2 memory.max of /pod)" in message
    with pytest.raises(MemoryBudgetError, match="holds no KV block"):
        plan(LIMIT, PROFILE, CacheRequest(16, MIB, 8192, 64, 0.8, kv_cache_memory_bytes=MIB - 1))
