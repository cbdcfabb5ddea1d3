"""The worker's Prometheus metrics, every series labelled with the model the worker serves.

`EngineMetrics` reads the batch-size, running, waiting, KV-usage, device-memory and prefix-cache
gauges from the engine's latest snapshot when Prometheus scrapes, and, as a step listener, observes
each step's time, counts the tokens it computed and the drafts speculative decoding scored and kept,
and moves the prefix cache's counters (queried and hit prompt blocks, whose ratio is the hit rate, and
evictions) by what the step added; the memory
budget's parts are set once, when the engine is built, and so is the native kernels' state. Rejected
submissions are counted by code where connection.py rejects them. This module must not decide
anything nor touch gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from services.worker.device_memory import device_memory_bytes

if TYPE_CHECKING:
    from collections.abc import Callable

    from services.worker.engine.async_engine import StepReport
    from services.worker.engine.engine import EngineStats
    from services.worker.memory_budget import MemoryBudget

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

BATCH_SIZE = Gauge("strata_batch_size", "Sequences in the engine's last step.", ["model"])
REQUESTS_RUNNING = Gauge("strata_requests_running", "Requests the engine is generating.", ["model"])
REQUESTS_WAITING = Gauge(
    "strata_requests_waiting", "Requests admitted by the worker and not yet scheduled.", ["model"]
)
KV_CACHE_USAGE = Gauge("strata_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", ["model"])
DEVICE_MEMORY = Gauge(
    "strata_device_memory_bytes",
    "Device memory in use: CUDA allocations on a GPU, the process's resident memory on the CPU.",
    ["model", "device"],
)
MEMORY_BUDGET = Gauge(
    "strata_memory_budget_bytes",
    "The worker's memory plan at start, by part: limit (what it may use), budget (memory_utilization of "
    "it), weights, runtime, activations (the measured peak of the largest step) and kv_cache.",
    ["model", "part"],
)
NATIVE_KERNELS = Gauge(
    "strata_native_kernels",
    "1 when the native CPU kernels serve this worker, 0 when it runs on torch's operators; the state "
    "label says which instruction set, or why they are off.",
    ["model", "state"],
)
STEP_SECONDS = Histogram(
    "strata_engine_step_seconds", "Wall time of one engine step.", ["model"], buckets=STEP_BUCKETS
)
STEP_TOKENS = Counter(
    "strata_engine_tokens_total",
    "Tokens the engine computed, by phase (prefill, decode, or draft: speculative tokens scored).",
    ["model", "phase"],
)
PREFIX_CACHED_BLOCKS = Gauge(
    "strata_prefix_cache_blocks",
    "KV blocks in the prefix cache, by state (cached: all indexed; evictable: no request holds them).",
    ["model", "state"],
)
PREFIX_QUERY_BLOCKS = Counter(
    "strata_prefix_cache_query_blocks_total",
    "Full prompt blocks new requests could have found in the prefix cache.",
    ["model"],
)
PREFIX_HIT_BLOCKS = Counter(
    "strata_prefix_cache_hit_blocks_total",
    "Full prompt blocks the prefix cache served (hit rate: this over the query blocks).",
    ["model"],
)
DRAFT_TOKENS = Counter(
    "strata_spec_draft_tokens_total",
    "Drafted tokens speculative decoding scored, by verdict (accepted or rejected): the acceptance rate "
    "is accepted over both.",
    ["model", "verdict"],
)
SPECULATIVE_DECODES = Counter(
    "strata_spec_decodes_total",
    "Decodes that scored drafts (accepted drafts over this: tokens gained per speculative decode).",
    ["model"],
)
PREFIX_EVICTIONS = Counter(
    "strata_prefix_cache_evictions_total", "Cached KV blocks evicted to make room for new ones.", ["model"]
)
PREEMPTIONS = Counter(
    "strata_preemptions_total",
    "Sequences preempted (KV freed, recomputed when readmitted): for KV blocks, after a step ran out of "
    "memory, or to give a running slot to a more urgent request.",
    ["model"],
)
WORKER_REJECTIONS = Counter(
    "strata_worker_rejections_total", "Submissions the worker refused, by gRPC code name.", ["model", "code"]
)


class EngineMetrics:
    """The gauges of one worker's engine, read from its latest snapshot when Prometheus scrapes (an
    idle engine runs no steps, so a value set per step would go stale), and its per-step series."""

    def __init__(self, model: str, device: str, snapshot: Callable[[], EngineStats | None]) -> None:
        """`snapshot()` is the engine's latest stats, None before it is built."""
        self._model = model
        self._snapshot = snapshot
        DEVICE_MEMORY.labels(model, device).set_function(lambda: device_memory_bytes(device))
        BATCH_SIZE.labels(model).set_function(lambda: self._read(_batch_size))
        REQUESTS_RUNNING.labels(model).set_function(lambda: self._read(lambda stats: stats.num_running))
        REQUESTS_WAITING.labels(model).set_function(lambda: self._read(lambda stats: stats.num_waiting))
        KV_CACHE_USAGE.labels(model).set_function(lambda: self._read(lambda stats: stats.kv_cache_usage))
        PREFIX_CACHED_BLOCKS.labels(model, "cached").set_function(
            lambda: self._read(lambda stats: stats.num_cached_blocks)
        )
        PREFIX_CACHED_BLOCKS.labels(model, "evictable").set_function(
            lambda: self._read(lambda stats: stats.num_evictable_blocks)
        )
        self._counted = (0, 0, 0, 0)
        """The prefix cache's (query blocks, hit blocks, evictions) and the preemptions already added
        to the counters."""

    def set_memory(self, budget: MemoryBudget) -> None:
        for part, size in budget.parts().items():
            MEMORY_BUDGET.labels(self._model, part).set(size)

    def set_native_kernels(self, state: str) -> None:
        NATIVE_KERNELS.labels(self._model, state).set(1.0 if state.startswith("on (") else 0.0)

    def _read(self, field: Callable[[EngineStats], float]) -> float:
        stats = self._snapshot()
        return 0.0 if stats is None else float(field(stats))

    def on_step(self, report: StepReport) -> None:
        stats, model = report.stats, self._model
        STEP_SECONDS.labels(model).observe(report.ended - report.started)
        STEP_TOKENS.labels(model, "decode").inc(stats.last_num_decodes)
        STEP_TOKENS.labels(model, "prefill").inc(stats.last_prefill_tokens)
        STEP_TOKENS.labels(model, "draft").inc(stats.last_num_draft_tokens)
        DRAFT_TOKENS.labels(model, "accepted").inc(stats.last_num_accepted_tokens)
        DRAFT_TOKENS.labels(model, "rejected").inc(
            stats.last_num_draft_tokens - stats.last_num_accepted_tokens
        )
        SPECULATIVE_DECODES.labels(model).inc(sum(1 for out in report.outputs if out.num_drafted))
        now = (stats.prefix_query_blocks, stats.prefix_hit_blocks, stats.num_evictions, stats.num_preemptions)
        queried, hit, evicted, preempted = (new - old for new, old in zip(now, self._counted, strict=True))
        self._counted = now
        PREFIX_QUERY_BLOCKS.labels(model).inc(queried)
        PREFIX_HIT_BLOCKS.labels(model).inc(hit)
        PREFIX_EVICTIONS.labels(model).inc(evicted)
        PREEMPTIONS.labels(model).inc(preempted)


def _batch_size(stats: EngineStats) -> float:
    """The last step's sequences; 0 once the engine has nothing left to run."""
    return float(stats.last_batch_size if stats.num_running or stats.num_waiting else 0)
