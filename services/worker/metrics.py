"""The worker's Prometheus metrics, every series labelled with the model the worker serves.

`EngineMetrics` is a step listener: after each engine step it sets the batch-size, running, waiting
and KV-usage gauges from the step's stats snapshot, observes the step's time, and counts the tokens
it produced. Device memory is read when Prometheus scrapes. Rejected submissions are counted by code
where connection.py rejects them. This module must not decide anything nor touch gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from services.worker.device_memory import device_memory_bytes

if TYPE_CHECKING:
    from services.worker.engine.async_engine import StepReport

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
STEP_SECONDS = Histogram(
    "strata_engine_step_seconds", "Wall time of one engine step.", ["model"], buckets=STEP_BUCKETS
)
STEP_TOKENS = Counter(
    "strata_engine_tokens_total",
    "Tokens the engine computed, by phase (prefill or decode).",
    ["model", "phase"],
)
WORKER_REJECTIONS = Counter(
    "strata_worker_rejections_total", "Submissions the worker refused, by gRPC code name.", ["model", "code"]
)


class EngineMetrics:
    """Updates the engine gauges after every step of one worker's engine."""

    def __init__(self, model: str, device: str) -> None:
        self._model = model
        DEVICE_MEMORY.labels(model, device).set_function(lambda: device_memory_bytes(device))

    def on_step(self, report: StepReport) -> None:
        stats, model = report.stats, self._model
        BATCH_SIZE.labels(model).set(stats.last_batch_size)
        REQUESTS_RUNNING.labels(model).set(stats.num_running)
        REQUESTS_WAITING.labels(model).set(stats.num_waiting)
        KV_CACHE_USAGE.labels(model).set(stats.kv_cache_usage)
        STEP_SECONDS.labels(model).observe(report.ended - report.started)
        STEP_TOKENS.labels(model, "decode").inc(stats.last_num_decodes)
        STEP_TOKENS.labels(model, "prefill").inc(stats.last_batch_tokens - stats.last_num_decodes)
