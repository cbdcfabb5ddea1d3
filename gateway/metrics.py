"""The gateway's Prometheus metrics: one module-level instance of each, in the default registry, every
series labelled with the model.

Requests are observed when they end (`observe_finished`): latency histograms and token counters carry
the model that served the request (a fallback's own name), while rejections, fallbacks and errors
carry the model the client asked for. Admission, the tokenize batcher and the worker links record
their own decisions and batches; queue depth and requests in flight are read from the router when
Prometheus scrapes (RouterCollector). The HTTP endpoint is strata.telemetry's. This module must not
decide anything: it declares the metrics and records facts it is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.stage_clock import STAGES

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from prometheus_client.core import Metric

    from strata.v1 import gateway_pb2

DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

TIME_TO_FIRST_TOKEN = Histogram(
    "strata_time_to_first_token_seconds",
    "From arrival at the gateway to the first token's text, by the model that served it.",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "strata_inter_token_latency_seconds",
    "Time between a stream's consecutive chunks divided by the tokens in the later one (one observation "
    "per token).",
    ["model"],
    buckets=TOKEN_BUCKETS,
)
REQUEST_DURATION = Histogram(
    "strata_request_duration_seconds",
    "From arrival at the gateway to the final message, for requests that completed.",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
QUEUE_TIME = Histogram(
    "strata_queue_time_seconds",
    "Time a completed request waited for a turn: the gateway's admission queue plus the worker's queue.",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
STAGE_TIME = Histogram(
    "strata_request_stage_seconds",
    "A completed request's time by stage (the parts of its response timing, which sum to its duration).",
    ["model", "stage"],
    buckets=LATENCY_BUCKETS,
)
GENERATED_TOKENS = Counter("strata_generated_tokens_total", "Tokens generated for clients.", ["model"])
PROMPT_TOKENS = Counter("strata_prompt_tokens_total", "Prompt tokens of completed requests.", ["model"])
REJECTIONS = Counter(
    "strata_rejections_total",
    "Requests a route refused or dropped from its queue, by reason "
    "(queue_full, token_budget, predicted_wait, ttft_slo, shed, deadline).",
    ["model", "reason"],
)
FALLBACKS = Counter(
    "strata_fallbacks_total",
    "Requests for a model served by its fallback, by reason "
    "(primary_unavailable, primary_saturated, primary_failed, failover).",
    ["model", "reason"],
)
REQUEST_ERRORS = Counter(
    "strata_request_errors_total",
    "Requests that ended with an error status, by gRPC code name (invalid_argument, unavailable, ...).",
    ["model", "code"],
)
REQUESTS = Counter(
    "strata_gateway_requests_total",
    "Requests that ended, by the front door they came through (protocol grpc or http) and how they ended "
    "(code ok, cancelled, or the error's gRPC code name).",
    ["model", "protocol", "code"],
)
HTTP_RESPONSES = Counter(
    "strata_gateway_http_responses_total",
    "Responses of the HTTP API by endpoint and status, those refused before the pipeline (401, 413, a "
    "malformed body) included.",
    ["endpoint", "status"],
)
STUCK_STREAMS = Counter(
    "strata_gateway_stuck_streams_total",
    "Streams cancelled because the client read nothing for stream_idle_timeout_s.",
    ["model"],
)
ADMISSION_DECISION_SECONDS = Histogram(
    "strata_gateway_admission_decision_seconds",
    "Time to decide whether a request joins a route's admission queue (outcome admitted or refused).",
    ["model", "outcome"],
    buckets=DECISION_BUCKETS,
)
TOKENIZE_BATCH_SIZE = Histogram(
    "strata_gateway_tokenize_batch_size",
    "Prompts of each model per Tokenize call.",
    ["model"],
    buckets=BATCH_BUCKETS,
)
SUBMISSION_BATCH_SIZE = Histogram(
    "strata_gateway_submission_batch_size",
    "Submissions per ConnectRequest sent to a worker.",
    ["model"],
    buckets=BATCH_BUCKETS,
)
WORKER_SUBMISSIONS = Counter(
    "strata_gateway_worker_submissions_total",
    "Requests submitted to each worker.",
    ["model", "worker"],
)


def observe_finished(response: gateway_pb2.GenerateResponse) -> None:
    """A request that completed: its latencies, its stages and its tokens, under the serving model."""
    model, timing = response.model, response.timing
    TIME_TO_FIRST_TOKEN.labels(model).observe(timing.time_to_first_token_ms / 1000.0)
    REQUEST_DURATION.labels(model).observe(timing.total_ms / 1000.0)
    QUEUE_TIME.labels(model).observe(timing.queue_ms / 1000.0)
    for stage in STAGES:
        STAGE_TIME.labels(model, stage).observe(getattr(timing, f"{stage}_ms") / 1000.0)
    GENERATED_TOKENS.labels(model).inc(response.usage.output_tokens)
    PROMPT_TOKENS.labels(model).inc(response.usage.input_tokens)


class RouterCollector(Collector):
    """Queue depth and requests in flight per model, read from every running gateway when scraped."""

    def __init__(self) -> None:
        self._sources: list[Callable[[], list[tuple[str, int, int]]]] = []

    def add(self, source: Callable[[], list[tuple[str, int, int]]]) -> None:
        """`source()` lists (model, queued requests, requests in flight) of one gateway."""
        self._sources.append(source)

    def remove(self, source: Callable[[], list[tuple[str, int, int]]]) -> None:
        if source in self._sources:
            self._sources.remove(source)

    def collect(self) -> Iterator[Metric]:
        queued = GaugeMetricFamily(
            "strata_gateway_queued_requests",
            "Requests waiting in a route's admission queue.",
            labels=["model"],
        )
        in_flight = GaugeMetricFamily(
            "strata_gateway_requests_in_flight",
            "Requests a route's workers hold (submitted, not yet finished).",
            labels=["model"],
        )
        totals: dict[str, list[int]] = {}
        for source in list(self._sources):
            for model, waiting, running in source():
                total = totals.setdefault(model, [0, 0])
                total[0] += waiting
                total[1] += running
        for model, (waiting, running) in sorted(totals.items()):
            queued.add_metric([model], waiting)
            in_flight.add_metric([model], running)
        yield queued
        yield in_flight


ROUTER_GAUGES = RouterCollector()
REGISTRY.register(ROUTER_GAUGES)
TENANT_REQUESTS = Counter(
    "strata_gateway_tenant_requests_total",
    "Requests by tenant (configured names only) and by what its quota said: reserved, or quota (refused).",
    ["tenant", "outcome"],
)
TENANT_RUNNING = Gauge(
    "strata_gateway_tenant_running_requests",
    "Requests a tenant has admitted and not finished in this gateway replica.",
    ["tenant"],
)
