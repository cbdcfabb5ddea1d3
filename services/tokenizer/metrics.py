"""The tokenizer service's Prometheus metrics, every series labelled with the model.

A batch may mix models, so a call's duration is observed once for each model it carried, and entries,
tokens and entry errors are counted per model. This module must not decide anything: it declares the
metrics and records one finished call.
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram

if TYPE_CHECKING:
    from collections.abc import Iterable

CALL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

CALL_SECONDS = Histogram(
    "strata_tokenizer_call_seconds",
    "Server-side time of a Tokenize or Detokenize call, observed once per model in its batch.",
    ["model", "method"],
    buckets=CALL_BUCKETS,
)
ENTRIES = Counter(
    "strata_tokenizer_entries_total",
    "Entries handled (one per prompt or per detokenized update).",
    ["model", "method"],
)
TOKENS = Counter(
    "strata_tokenizer_tokens_total",
    "Token ids produced (Tokenize) or turned into text (Detokenize).",
    ["model", "method"],
)
ENTRY_ERRORS = Counter(
    "strata_tokenizer_entry_errors_total",
    "Entries answered with an error, by gRPC code name.",
    ["model", "method", "code"],
)


def record_call(method: str, seconds: float, entries: Iterable[tuple[str, int, str]]) -> None:
    """One call: (model, tokens, error code name or "") per entry."""
    per_model: Tally[str] = Tally()
    for model, tokens, error in entries:
        per_model[model] += 1
        if error:
            ENTRY_ERRORS.labels(model=model, method=method, code=error).inc()
        else:
            TOKENS.labels(model=model, method=method).inc(tokens)
    for model, count in per_model.items():
        ENTRIES.labels(model=model, method=method).inc(count)
        CALL_SECONDS.labels(model=model, method=method).observe(seconds)
