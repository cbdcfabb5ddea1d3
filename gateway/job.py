"""What one request's path through the gateway carries: the incoming call's facts, the request's
shared facts (Job), and each submission of it to a worker (Attempt).

This module must not do I/O nor decide anything: pipeline.py does, with these records.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.admission import Priority, Ticket

if TYPE_CHECKING:
    from collections.abc import Mapping

    from opentelemetry.trace import Span

    from gateway.fallback import Detour, FallbackPolicy
    from gateway.request_state import OpenRequest
    from gateway.request_trace import RequestTrace
    from gateway.route import Route
    from gateway.validation import ValidRequest
    from gateway.worker_link import WorkerLink

TRACE_KEYS = ("traceparent", "tracestate")
_WIRE_SEQUENCE = itertools.count(1)


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What the pipeline needs from the incoming call."""

    deadline_unix_ms: int = 0
    """Absolute deadline; 0 is none."""
    trace_context: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Job:
    """One request's facts that every attempt shares."""

    valid: ValidRequest
    call: CallInfo
    primary: Route
    policy: FallbackPolicy
    priority: Priority
    deadline: float | None
    """time.monotonic() deadline; None when the call has none."""
    trace: RequestTrace

    def ticket(self, prompt_tokens: int, prior_tokens: int = 0) -> Ticket:
        return Ticket(
            request_id=self.valid.request_id,
            prompt_tokens=prompt_tokens + prior_tokens,
            max_new_tokens=self.valid.sampling.max_new_tokens - prior_tokens,
            priority=self.priority,
            deadline=self.deadline,
        )


@dataclass(frozen=True, slots=True)
class Attempt:
    """One submission of the request: where it runs and what it was sent."""

    route: Route
    link: WorkerLink | None
    """None when the submission failed at once (its failure waits on `handle`)."""
    handle: OpenRequest
    prompt_ids: list[int]
    detour: Detour | None
    hop: Span | None = None
    """The attempt's Connect span (None when untraced)."""
    replica_retries: int = 0
    """Attempts before this one on other replicas of the same route, after losing a worker."""


def wire_id(valid: ValidRequest) -> str:
    """The id of one submission on the worker stream: `<request_id>#<n>`, unique there even when two
    callers choose the same request_id, and for each attempt of one request, so a retry on the same
    worker is never confused with the attempt it replaces (its late updates, its cancellation)."""
    return f"{valid.request_id}#{next(_WIRE_SEQUENCE)}"
