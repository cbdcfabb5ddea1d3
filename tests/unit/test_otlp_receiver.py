"""The in-process OTLP receiver, fed by the real OpenTelemetry SDK and its OTLP/gRPC exporter."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from strata.otlp_receiver import OtlpReceiver, ReceivedSpan
from strata.tracing import Tracing

if TYPE_CHECKING:
    from collections.abc import Iterator

# Export is synchronous (SimpleSpanProcessor) and local: well under a second; 5x and more of margin.
WAIT_S = 10.0


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


def _tracing(receiver: OtlpReceiver, service: str) -> Tracing:
    exporter = OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True, timeout=WAIT_S)
    return Tracing.with_exporter(service, exporter, 1.0, batch=False)


def _by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {span.name: span for span in spans}


def test_start_gives_a_local_address_and_endpoint() -> None:
    receiver = OtlpReceiver()
    with pytest.raises(RuntimeError, match="not started"):
        _ = receiver.endpoint
    address = receiver.start()
    try:
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1"
        assert int(port) > 0
        assert receiver.endpoint == f"http://{address}"
        with pytest.raises(RuntimeError, match="already serves"):
            receiver.start()
    finally:
        receiver.stop()
    receiver.stop()  # idempotent


def test_parent_child_attributes_link_and_service(receiver: OtlpReceiver) -> None:
    tracing = _tracing(receiver, "svc-under-test")
    try:
        other = tracing.span("other", start=time.perf_counter())
        assert other is not None
        tracing.end(other)
        started = time.perf_counter()
        parent = tracing.span(
            "parent",
            start=started,
            kind=SpanKind.SERVER,
            attributes={"req.id": "r-1", "tokens": 7, "ratio": 0.5, "ok": True, "ids": [1, 2, 3]},
        )
        assert parent is not None
        link = tracing.link(other.get_span_context(), step=3)
        assert link is not None
        child = tracing.span("child", parent=parent, start=started + 0.001, end=started + 0.003, links=[link])
        assert child is not None
        parent.set_status(Status(StatusCode.ERROR, "boom"))
        tracing.end(parent, started + 0.005)
    finally:
        tracing.shutdown()

    spans = _by_name(receiver.wait_for(lambda got: len(got) >= 3, WAIT_S))
    assert set(spans) == {"other", "parent", "child"}
    got_parent, got_child, got_other = spans["parent"], spans["child"], spans["other"]
    assert {span.service for span in spans.values()} == {"svc-under-test"}

    context = parent.get_span_context()
    assert got_parent.trace_id == format(context.trace_id, "032x")
    assert got_parent.span_id == format(context.span_id, "016x")
    assert len(got_parent.trace_id) == 32 and len(got_parent.span_id) == 16
    assert got_parent.parent_span_id == ""
    assert got_child.trace_id == got_parent.trace_id
    assert got_child.parent_span_id == got_parent.span_id
    assert got_other.trace_id != got_parent.trace_id

    assert got_parent.attributes == {"req.id": "r-1", "tokens": 7, "ratio": 0.5, "ok": True, "ids": [1, 2, 3]}
    assert got_parent.kind == 2  # SPAN_KIND_SERVER
    assert got_child.kind == 1  # SPAN_KIND_INTERNAL
    assert got_parent.status_code == 2  # STATUS_CODE_ERROR
    assert got_child.status_code == 0
    assert got_child.links == [(got_other.trace_id, got_other.span_id)]
    assert got_child.duration_ms == pytest.approx(2.0, abs=0.01)
    assert got_parent.duration_ms == pytest.approx(5.0, abs=0.01)
    assert got_child.start_ns - got_parent.start_ns == pytest.approx(1_000_000, abs=10_000)


def test_two_services_clear_and_count(receiver: OtlpReceiver) -> None:
    first, second = _tracing(receiver, "alpha"), _tracing(receiver, "beta")
    try:
        first.end(first.span("a"))
        second.end(second.span("b"))
        spans = receiver.wait_for(lambda got: len(got) >= 2, WAIT_S)
        assert {(span.service, span.name) for span in spans} == {("alpha", "a"), ("beta", "b")}
        assert receiver.span_count == 2
        receiver.clear()
        assert receiver.span_count == 0
        assert receiver.spans() == []
        first.end(first.span("again"))
        assert [span.name for span in receiver.wait_for(bool, WAIT_S)] == ["again"]
    finally:
        first.shutdown()
        second.shutdown()


def test_wait_for_times_out_naming_what_came(receiver: OtlpReceiver) -> None:
    tracing = _tracing(receiver, "svc")
    try:
        tracing.end(tracing.span("seen-span"))
    finally:
        tracing.shutdown()
    receiver.wait_for(lambda got: len(got) == 1, WAIT_S)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"has 1: svc/seen-span x1"):
        receiver.wait_for(lambda got: any(span.name == "never" for span in got), 0.2)
    assert time.monotonic() - started < WAIT_S


def test_receives_from_batched_exporter_inside_an_event_loop(receiver: OtlpReceiver) -> None:
    """A service's setup: batch processor, spans made on an asyncio loop; the sync server still serves."""

    async def emit() -> list[ReceivedSpan]:
        exporter = OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True, timeout=WAIT_S)
        tracing = Tracing.with_exporter("async-svc", exporter, 1.0, batch=True)
        for index in range(20):
            tracing.end(tracing.span(f"s{index}"))
            await asyncio.sleep(0)
        # shutdown flushes the batch; the receiver answers from its own threads meanwhile.
        await asyncio.to_thread(tracing.shutdown)
        return await asyncio.to_thread(receiver.wait_for, lambda got: len(got) >= 20, WAIT_S)

    spans = asyncio.run(emit())
    assert sorted(span.name for span in spans) == sorted(f"s{index}" for index in range(20))
    assert all(span.service == "async-svc" for span in spans)
