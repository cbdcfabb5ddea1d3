"""One service's OpenTelemetry tracing: its tracer, W3C propagation, and spans placed on its own clock.

A service gets one Tracing at start (`Tracing.start`, from its telemetry settings' tracing fields
and the standard OTEL_* variables) and hands it to whatever records spans. With tracing off it is
`Tracing.off()`: every method returns None or an empty carrier and builds no span, so callers guard
nothing but a None. Spans are often placed after the fact from timestamps the request path already
took with time.perf_counter (or time.monotonic: one clock on Linux), so `wall_ns` converts those to
the epoch nanoseconds a span needs. W3C trace context travels as a plain str->str carrier: gRPC metadata, or a
message's trace_context map; no gRPC instrumentation wraps our stubs, so a traced stream keeps its
`.cancel()`. This module must not decide which spans a request gets (the services do) nor read the
environment anywhere but in `start`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, SpanContext, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

__all__ = ["Link", "SpanKind", "Tracing", "trace_id_hex"]

DEFAULT_OTLP_ENDPOINT = "http://localhost:4317"
# A forward span links every engine step it took part in; a long generation keeps its first 1024.
MAX_LINKS = 1024
_PROPAGATOR = TraceContextTextMapPropagator()


def trace_id_hex(span: Span | None) -> str:
    """The 32-hex-digit trace id of a sampled span; "" for None or an unsampled one."""
    if span is None:
        return ""
    context = span.get_span_context()
    return format(context.trace_id, "032x") if context.trace_flags.sampled else ""


class Tracing:
    """A service's tracer, or none (tracing off): then nothing is built and every carrier is empty."""

    def __init__(self, provider: TracerProvider | None, service_name: str) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("strata", schema_url=None) if provider is not None else None
        self.service_name = service_name
        # perf_counter and monotonic share CLOCK_MONOTONIC on Linux; one anchor maps both to the epoch.
        self._anchor_ns = time.time_ns() - time.perf_counter_ns()

    @classmethod
    def off(cls) -> Tracing:
        return cls(None, "")

    @classmethod
    def start(
        cls,
        service_name: str,
        mode: str,
        otlp_endpoint: str,
        sampling_ratio: float | None,
        environ: Mapping[str, str] | None = None,
    ) -> Tracing:
        """The service's tracing as its telemetry settings (`tracing` as `mode`, `otlp_endpoint`,
        `sampling_ratio`) and OTEL_* variables say; off unless they enable it.

        `tracing: auto` traces when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set and
        OTEL_SDK_DISABLED is not true. The endpoint is the settings' otlp_endpoint, else those
        variables, else localhost:4317. The sampler is parent-based with the settings' ratio; without
        one the SDK reads OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG (default: always on).
        """
        env = os.environ if environ is None else environ
        endpoint_env = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if mode == "off" or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return cls.off()
        if mode == "auto" and not (endpoint_env or otlp_endpoint):
            return cls.off()
        endpoint = otlp_endpoint or endpoint_env or DEFAULT_OTLP_ENDPOINT
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
        return cls.with_exporter(service_name, exporter, sampling_ratio, batch=True)

    @classmethod
    def with_exporter(
        cls, service_name: str, exporter: SpanExporter, sampling_ratio: float | None = 1.0, *, batch: bool
    ) -> Tracing:
        """Tracing into `exporter`: batched for services, synchronous for tests that read spans at once."""
        sampler = None if sampling_ratio is None else ParentBased(TraceIdRatioBased(sampling_ratio))
        provider = TracerProvider(
            sampler=sampler,
            resource=Resource.create({"service.name": service_name}),
            shutdown_on_exit=False,
            span_limits=SpanLimits(max_links=MAX_LINKS),
        )
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        return cls(provider, service_name)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def wall_ns(self, perf_seconds: float) -> int:
        """Epoch nanoseconds of a time.perf_counter() or time.monotonic() reading."""
        return self._anchor_ns + int(perf_seconds * 1e9)

    def span(
        self,
        name: str,
        *,
        parent: Context | Span | None = None,
        start: float | None = None,
        end: float | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] = (),
    ) -> Span | None:
        """A span from `start` (perf_counter seconds; now when None), ended at `end` when given.

        `parent` is an extracted context or a span; None starts a new trace.
        """
        if self._tracer is None:
            return None
        context = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
        span = self._tracer.start_span(
            name,
            context=context,
            kind=kind,
            attributes=attributes,
            links=links,
            start_time=None if start is None else self.wall_ns(start),
        )
        if end is not None:
            span.end(end_time=self.wall_ns(end))
        return span

    def end(self, span: Span | None, at: float | None = None) -> None:
        """End `span` at `at` (perf_counter seconds; now when None)."""
        if span is not None:
            span.end(end_time=None if at is None else self.wall_ns(at))

    def extract(self, carrier: Mapping[str, str]) -> Context | None:
        """The remote parent in a traceparent/tracestate carrier; None when tracing is off or it has none."""
        if self._tracer is None or "traceparent" not in carrier:
            return None
        return _PROPAGATOR.extract(dict(carrier))

    def carrier(self, span: Span | None) -> dict[str, str]:
        """traceparent (and tracestate) naming `span` as the parent; empty when there is no span."""
        if span is None:
            return {}
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
        return out

    @staticmethod
    def link(context: SpanContext | None, **attributes: Any) -> Link | None:
        return None if context is None else Link(context, attributes or None)

    def shutdown(self) -> None:
        """Flush what is buffered and stop exporting."""
        if self._provider is not None:
            self._provider.shutdown()
