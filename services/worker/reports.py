"""What a worker says about itself: GetWorkerInfo's engine part, GetWorkerStats, each step's StepInfo,
and the native CPU kernels' state line.

It reads the engine and its step reports and builds messages from them; it owns no state and must not
change the engine, the credits or any stream (host.py owns those and calls these functions).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from services.worker.convert import memory_budget
from services.worker.engine.async_engine import EngineDeadError
from services.worker.model import native
from strata.v1 import worker_pb2

if TYPE_CHECKING:
    from services.worker.engine.async_engine import AsyncEngine, StepReport
    from services.worker.engine.engine import LLMEngine

log = logging.getLogger(__name__)


def native_kernels_state(device: str, engine: LLMEngine) -> str:
    """The kernels' state after the warm-up ran them. A CPU worker that wanted them and cannot load
    them says so loudly at start (and the host puts it in metrics and GetWorkerInfo), not in one line
    of a log."""
    if not device.startswith("cpu"):
        return f"not used (they are CPU kernels; this worker runs on {device})"
    state = native.status()
    if native.enabled() and native.library() is None:
        log.warning(
            "NATIVE CPU KERNELS OFF: serving through torch's operators, about 1.5x slower per decode "
            "step: %s",
            state,
        )
        return state
    loaded = engine.runner.loaded
    # A family the native decode stack does not cover says so once, where operators look.
    log.info(
        "native CPU kernels: %s; %s %s: %s",
        state,
        loaded.family,
        loaded.config.architecture,
        loaded.model.native_paths.describe(),
    )
    return state


def add_engine_info(info: worker_pb2.GetWorkerInfoResponse, engine: AsyncEngine) -> None:
    """Fill info's limits, memory budget and model family from the engine, once it is built."""
    with contextlib.suppress(EngineDeadError):
        built = engine.engine
        info.max_model_len = built.max_model_len
        info.eos_token_ids.extend(built.model_config.eos_token_ids)
        info.memory.CopyFrom(memory_budget(built.memory))
        loaded = built.runner.loaded
        info.model_family = loaded.family
        info.native_paths = loaded.model.native_paths.describe()
        info.weights_format = loaded.weights_format


def worker_stats(open_requests: int, engine: AsyncEngine) -> worker_pb2.GetWorkerStatsResponse:
    """The engine's snapshot after its last step, plus the streams' open requests."""
    response = worker_pb2.GetWorkerStatsResponse(open_requests=open_requests)
    with contextlib.suppress(EngineDeadError):
        stats = engine.stats()
        response.running = stats.num_running
        response.waiting = stats.num_waiting
        response.used_kv_blocks = stats.num_blocks - stats.num_free_blocks
        response.total_kv_blocks = stats.num_blocks
        response.free_kv_tokens = stats.free_kv_tokens
        response.steps = stats.num_steps
        response.cached_kv_blocks = stats.num_cached_blocks
        response.evictable_kv_blocks = stats.num_evictable_blocks
        response.prefix_cache_evictions = stats.num_evictions
        response.prefix_cache_query_blocks = stats.prefix_query_blocks
        response.prefix_cache_hit_blocks = stats.prefix_hit_blocks
        response.draft_tokens = stats.num_draft_tokens
        response.accepted_draft_tokens = stats.num_accepted_tokens
        response.speculative_decodes = stats.num_speculative_decodes
        response.preemptions = stats.num_preemptions
    return response


def step_info(report: StepReport) -> worker_pb2.StepInfo:
    """The step as the Connect stream reports it; its duration is the step span's."""
    stats = report.stats
    return worker_pb2.StepInfo(
        step=stats.num_steps,
        duration_ms=(report.ended - report.started) * 1000.0,
        decodes=stats.last_num_decodes,
        prefill_tokens=stats.last_prefill_tokens,
        running=stats.num_running,
        waiting=stats.num_waiting,
        max_running=stats.effective_max_num_seqs,
        prefill_budget=stats.prefill_budget,
        draft_tokens=stats.last_num_draft_tokens,
    )
