"""The worker's spans: one `step` span per engine step, and per request a `queue` and a `forward` span.

A step span is the root of its own trace (a step serves many requests, each in its own trace) and
carries the batch's shape: sequences, prefill, decode and drafted tokens (and the drafts kept), and the
step's time. A request's
spans join the trace context its submission carried: `queue` from the worker's receipt of the
submission to the start of the first step that produced one of its tokens, `forward` from there to
the end of the step that produced its last, linked to every step span it took part in, with the
tokens speculative decoding drafted for it and kept. Their times
are the same readings the request's TokenUpdates report (queue_ms, forward_ms), so a trace and the
response timing agree. With tracing off nothing here builds a span. This module must not send
messages nor decide a request's fate (connection.py does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import Status, StatusCode

from strata.tracing import MAX_LINKS, SpanKind

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from opentelemetry.context import Context
    from opentelemetry.trace import Link

    from services.worker.engine.async_engine import StepReport
    from strata.tracing import Tracing


@dataclass(slots=True)
class RequestSpans:
    """What a traced request's spans need until it ends."""

    parent: Context
    links: list[Link] = field(default_factory=list)


class WorkerSpans:
    """Builds the worker's spans for one model (none when tracing is off)."""

    def __init__(self, tracing: Tracing, model: str) -> None:
        self._tracing = tracing
        self._model = model
        self._step_link: Link | None = None

    @property
    def enabled(self) -> bool:
        return self._tracing.enabled

    def step(self, report: StepReport) -> None:
        """The step span of `report`; requests whose tokens it produced link to it (see `join`)."""
        self._step_link = None
        if not self._tracing.enabled:
            return
        stats = report.stats
        span = self._tracing.span(
            "step",
            start=report.started,
            end=report.ended,
            attributes={
                "gen_ai.request.model": self._model,
                "strata.step": stats.num_steps,
                "strata.batch_size": stats.last_batch_size,
                "strata.prefill_tokens": stats.last_prefill_tokens,
                "strata.decode_tokens": stats.last_num_decodes,
                "strata.draft_tokens": stats.last_num_draft_tokens,
                "strata.accepted_draft_tokens": stats.last_num_accepted_tokens,
                "strata.outputs": len(report.outputs),
                "strata.running": stats.num_running,
                "strata.waiting": stats.num_waiting,
                "strata.kv_cache_usage": stats.kv_cache_usage,
            },
        )
        if span is not None:
            self._step_link = self._tracing.link(span.get_span_context())

    def start(self, carrier: Mapping[str, str]) -> RequestSpans | None:
        """A submitted request's span state; None when untraced (tracing off, or no parent given)."""
        parent = self._tracing.extract(carrier)
        return None if parent is None else RequestSpans(parent)

    def join(self, spans: RequestSpans | None) -> None:
        """The request took part in the step last passed to `step`."""
        if spans is not None and self._step_link is not None and len(spans.links) < MAX_LINKS:
            spans.links.append(self._step_link)

    def finish(
        self,
        spans: RequestSpans | None,
        *,
        submitted: float,
        first_step: float | None,
        ended: float,
        output_tokens: int,
        finish_reason: str,
        error: str = "",
        cached_prompt_tokens: int = 0,
        draft_tokens: int = 0,
        accepted_draft_tokens: int = 0,
    ) -> None:
        """End the request's `queue` (and, once it was scheduled, `forward`) span."""
        if spans is None:
            return
        queued_until = ended if first_step is None else first_step
        queue_attributes = {"strata.queue": "worker", "gen_ai.request.model": self._model}
        queue_error = error if first_step is None else ""
        self._emit("queue", spans.parent, submitted, queued_until, queue_attributes, (), queue_error)
        if first_step is None:
            return
        forward_attributes = {
            "gen_ai.request.model": self._model,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.response.finish_reasons": [finish_reason],
            "strata.steps": len(spans.links),
            "strata.cached_prompt_tokens": cached_prompt_tokens,
            "strata.draft_tokens": draft_tokens,
            "strata.accepted_draft_tokens": accepted_draft_tokens,
        }
        self._emit("forward", spans.parent, first_step, ended, forward_attributes, spans.links, error)

    def _emit(
        self,
        name: str,
        parent: Context,
        start: float,
        end: float,
        attributes: Mapping[str, object],
        links: Sequence[Link],
        error: str,
    ) -> None:
        span = self._tracing.span(
            name, parent=parent, start=start, kind=SpanKind.SERVER, attributes=attributes, links=links
        )
        if span is not None and error:
            span.set_status(Status(StatusCode.ERROR, error))
        self._tracing.end(span, max(end, start))
