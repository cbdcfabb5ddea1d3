"""An in-process OTLP/gRPC trace receiver: what tests and benchmarks point a service's exporter at.

`OtlpReceiver` is a real grpc server on 127.0.0.1 (a free port) implementing the collector's
TraceService; every exported span is decoded into a plain, immutable `ReceivedSpan` and kept in
arrival order until `clear`. The server is the synchronous, thread-pool kind, so it runs next to sync
code and next to an asyncio loop alike, and its handler threads are the only writers of the span list.
This module must not decide which spans a service should emit, nor judge them (callers assert on
`spans()` or `wait_for`); it keeps everything it receives, so it is for bounded test and benchmark runs.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from types import TracebackType

    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

__all__ = ["OtlpReceiver", "ReceivedSpan", "decode_span"]

_POLL_S = 0.02
# Exporters send up to 512 spans a call by default; a long trace's links make a call a few MiB.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as an OTLP exporter sent it, ids as lowercase hex."""

    service: str
    """The resource's service.name ("" when it has none)."""
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    """16 hex digits, or "" for a root span."""
    start_ns: int
    end_ns: int
    kind: int
    """opentelemetry.proto.trace.v1.Span.SpanKind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer."""
    attributes: dict[str, object] = field(default_factory=dict)
    links: list[tuple[str, str]] = field(default_factory=list)
    """(trace_id, span_id) of each linked span."""
    status_code: int = 0
    """opentelemetry.proto.trace.v1.Status.StatusCode: 0 unset, 1 ok, 2 error."""

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _any_value(value: AnyValue) -> object:
    """A string, int, float, bool or bytes, or a list of them; None for an empty value."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind)


def _attributes(pairs: Iterable[KeyValue]) -> dict[str, object]:
    return {pair.key: _any_value(pair.value) for pair in pairs}


def decode_span(span: Span, service: str) -> ReceivedSpan:
    """The plain form of one OTLP span of the resource named `service`."""
    return ReceivedSpan(
        service=service,
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        kind=span.kind,
        attributes=_attributes(span.attributes),
        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
        status_code=span.status.code,
    )


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[ReceivedSpan]], None]) -> None:
        self._sink = sink

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = resource.get("service.name")
            name = service if isinstance(service, str) else ""
            for scope_spans in resource_spans.scope_spans:
                received.extend(decode_span(span, name) for span in scope_spans.spans)
        self._sink(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """A trace collector on 127.0.0.1:<free port>; `start` it (or use `with`), point exporters at
    `endpoint`, read `spans()`."""

    def __init__(self, max_workers: int = 4) -> None:
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server: grpc.Server | None = None
        self._address = ""

    def start(self) -> str:
        """Serve on a free port; returns "127.0.0.1:PORT". Starting a started receiver is an error."""
        if self._server is not None:
            raise RuntimeError(f"the receiver already serves at {self._address}")
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="otlp-receiver"),
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        # The generated registration function is untyped.
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _TraceService(self._add), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server
        self._address = f"127.0.0.1:{port}"
        return self._address

    @property
    def address(self) -> str:
        """host:port; raises before `start`."""
        if not self._address:
            raise RuntimeError("the receiver is not started: call start() or use it as a context manager")
        return self._address

    @property
    def endpoint(self) -> str:
        """The URL an OTLPSpanExporter (insecure) or a service's otlp_endpoint takes."""
        return f"http://{self.address}"

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (exports in flight get `grace_s`); the spans received stay readable. Idempotent."""
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order (a copy)."""
        with self._lock:
            return list(self._spans)

    @property
    def span_count(self) -> int:
        with self._lock:
            return len(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float
    ) -> list[ReceivedSpan]:
        """The spans, once `predicate` holds for them; TimeoutError naming what came if it never does.

        Exporters batch (a service's BatchSpanProcessor sends every 5 s by default), so a test waits
        for the spans it needs rather than sleeping.
        """
        end = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() >= end:
                raise TimeoutError(
                    f"the OTLP receiver at {self._address or '(not started)'} did not get the expected spans "
                    f"within {timeout_s:g} s; it has {len(spans)}: {_describe(spans)}"
                )
            time.sleep(_POLL_S)


def _describe(spans: list[ReceivedSpan], limit: int = 40) -> str:
    """Span counts by service and name, e.g. "gateway/request x3, worker/forward x3"."""
    counts: dict[str, int] = {}
    for span in spans:
        key = f"{span.service}/{span.name}"
        counts[key] = counts.get(key, 0) + 1
    parts = [f"{key} x{count}" for key, count in sorted(counts.items())]
    more = f", ... ({len(parts) - limit} more names)" if len(parts) > limit else ""
    return (", ".join(parts[:limit]) + more) if parts else "none"
