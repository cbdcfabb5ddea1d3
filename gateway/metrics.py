"""The gateway's Prometheus metrics: one module-level instance of each, in the default registry.

Admission records how long each decision took and why requests were refused; the fallback logic
counts what it sent elsewhere and why; the tokenize batcher and the worker links record the batches
they make. Exposing the registry over HTTP belongs to the server. This module must not decide anything:
it only declares the metrics, so that every component (and a test) reads the same objects.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

ADMISSION_DECISION_SECONDS = Histogram(
    "strata_gateway_admission_decision_seconds",
    "Time to decide whether a request joins a route's admission queue (outcome admitted or refused).",
    ["route", "outcome"],
    buckets=DECISION_BUCKETS,
)
REFUSALS = Counter(
    "strata_gateway_refusals_total",
    "Requests a route refused or dropped from its queue, by reason "
    "(queue_full, token_budget, predicted_wait, ttft_slo, shed, deadline).",
    ["route", "reason"],
)
FALLBACKS = Counter(
    "strata_gateway_fallbacks_total",
    "Requests served by a route's fallback, by reason "
    "(primary_unavailable, primary_saturated, primary_failed, failover).",
    ["route", "reason"],
)
TOKENIZE_BATCH_SIZE = Histogram(
    "strata_gateway_tokenize_batch_size",
    "Prompts per Tokenize call.",
    buckets=BATCH_BUCKETS,
)
SUBMISSION_BATCH_SIZE = Histogram(
    "strata_gateway_submission_batch_size",
    "Submissions per ConnectRequest sent to a worker.",
    ["route"],
    buckets=BATCH_BUCKETS,
)
WORKER_SUBMISSIONS = Counter(
    "strata_gateway_worker_submissions_total",
    "Requests submitted to each worker.",
    ["route", "worker"],
)
