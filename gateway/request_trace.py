"""One request's spans in the gateway, and the line it logs when it ends.

The request span opens at arrival (a child of the caller's trace context when the call carried one)
and is named and attributed by the GenAI semantic conventions. Each hop gets a CLIENT span opened
before the call so the remote service can hang its own spans under it: `Tokenize` (the tokenizer's
`preprocess` joins it) and one `Connect` per worker attempt (the worker's `queue` and `forward`
join it). The gateway-side parts of the StageClock become spans as the clock gives them out: `queue`
(admission), `network` (half before and half after each remote span), `decode`. So the leaf spans of
a trace tile the request span, and each stage's spans add up to that part of the response timing.
With tracing off no span is built, but the log line is still written (a tenant's refusals only as many
a second as refusal_log.py lets through). No text of the request (prompt
or completion) goes into a span or a log line unless `telemetry.record_content` is on. This module
must not decide where a request goes nor measure time (the pipeline and the StageClock do).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc
from opentelemetry.trace import Status, StatusCode

from gateway.refusal_log import REFUSALS
from gateway.stage_clock import STAGES
from strata.tracing import SpanKind, trace_id_hex
from strata.v1 import common_pb2

if TYPE_CHECKING:
    from collections.abc import Mapping

    from opentelemetry.trace import Span

    from gateway.errors import GatewayError
    from gateway.request_values import Incoming
    from gateway.stage_clock import StageClock
    from gateway.validation import ValidRequest
    from strata.tracing import Tracing
    from strata.v1 import gateway_pb2

log = logging.getLogger("strata.requests")

TRACE_KEYS = ("traceparent", "tracestate")
"""The W3C trace context a front door reads from the caller (gRPC metadata, HTTP headers)."""
TOKENIZE_RPC = "strata.v1.TokenizerService/Tokenize"
CONNECT_RPC = "strata.v1.WorkerService/Connect"


def finish_reason_name(reason: common_pb2.FinishReason.ValueType) -> str:
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


class RequestTrace:
    """The spans of one request (none when tracing is off) and its final log line."""

    def __init__(
        self, tracing: Tracing, incoming: Incoming, arrival: float, record_content: bool = False
    ) -> None:
        """`record_content` puts the prompt and the completion into the span and the log line."""
        request = incoming.request
        self._tracing = tracing
        self._arrival = arrival
        self._content = _content(request) if record_content else None
        self._forecast_ms: float | None = None
        self._tenant = incoming.tenant
        self._protocol = incoming.protocol
        operation = "chat" if len(request.messages) else "text_completion"
        self._operation = operation
        protocol = {"rpc.system": "grpc"} if incoming.protocol == "grpc" else {}
        self.span = tracing.span(
            operation,  # the model joins the name once validated: span names stay few
            parent=tracing.extract(incoming.trace_context),
            start=arrival,
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": request.model,
                "network.protocol.name": incoming.protocol,
                "strata.tenant": incoming.tenant,
                **protocol,
            },
        )
        self.trace_id = trace_id_hex(self.span)
        self._emitted = 0
        self._ended = False
        self._adapter = ""
        """The LoRA adapter the request named ("" for a base model), once validated."""

    def validated(self, valid: ValidRequest) -> None:
        """The request's resolved model and sampling (defaults filled in)."""
        self._adapter = valid.adapter
        if self.span is not None:
            self.span.update_name(f"{self._operation} {valid.model}")
            sampling = valid.sampling
            self.span.set_attributes(
                {
                    "gen_ai.request.model": valid.model,
                    "strata.lora_adapter": valid.adapter,
                    "gen_ai.request.max_tokens": sampling.max_new_tokens,
                    "gen_ai.request.temperature": sampling.temperature,
                    "strata.request_id": valid.request_id,
                }
            )
            if sampling.HasField("top_p"):
                self.span.set_attribute("gen_ai.request.top_p", sampling.top_p)

    def open_hop(self, rpc: str, start: float, **attributes: str) -> Span | None:
        """A CLIENT span for one call to another service, child of the request span."""
        if self.span is None:
            return None
        service, _, method = rpc.partition("/")
        return self._tracing.span(
            rpc,
            parent=self.span,
            start=start,
            kind=SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, **attributes},
        )

    def carrier(self, hop: Span | None) -> dict[str, str]:
        """The trace context a remote service's spans take as their parent (empty when untraced)."""
        return self._tracing.carrier(hop)

    def close_hop(self, hop: Span | None, end: float) -> None:
        self._tracing.end(hop, end)

    def emit(self, clock: StageClock, hops: Mapping[str, Span | None] | None = None) -> None:
        """Spans for the clock's segments given out since the last call; a hop's go under its span."""
        segments = clock.segments[self._emitted :]
        self._emitted = len(clock.segments)
        if self.span is None:
            return
        for segment in segments:
            parent = (hops or {}).get(segment.hop) or self.span
            attributes = {"strata.hop": segment.hop} if segment.hop else None
            self._tracing.span(
                segment.stage, parent=parent, start=segment.start, end=segment.end, attributes=attributes
            )

    def routed(self, replica: str, reason: str, preferred: str) -> None:
        """The replica the request's credit was granted on, why (prefix_routing.py's reasons), and
        the replica its prefix preferred (empty without a prefix key)."""
        if self.span is not None:
            self.span.set_attributes(
                {
                    "strata.route.replica": replica,
                    "strata.route.reason": reason,
                    "strata.route.preferred": preferred,
                }
            )

    def admitted(self, forecast_ttft_s: float | None, arrival: float) -> None:
        """A route admitted the request with this forecast of its first token (from its arrival, as
        `time_to_first_token_ms` counts), so that the forecast stands next to what happened."""
        if forecast_ttft_s is None:
            return
        self._forecast_ms = (time.perf_counter() - arrival + forecast_ttft_s) * 1000.0
        if self.span is not None:
            self.span.set_attribute("strata.forecast_ttft_ms", self._forecast_ms)

    def finish(self, response: gateway_pb2.GenerateResponse, device_memory_bytes: int) -> None:
        """The request completed: GenAI attributes, the timing parts, the log line; ends the span."""
        timing = response.timing
        finish = finish_reason_name(response.finish_reason)
        if self.span is not None:
            self.span.set_attributes(
                {
                    "gen_ai.response.model": response.model,
                    "gen_ai.response.id": response.request_id,
                    "gen_ai.usage.input_tokens": response.usage.input_tokens,
                    "gen_ai.usage.output_tokens": response.usage.output_tokens,
                    "strata.usage.cached_input_tokens": response.usage.cached_input_tokens,
                    "strata.usage.draft_tokens": response.usage.draft_tokens,
                    "strata.usage.accepted_draft_tokens": response.usage.accepted_draft_tokens,
                    "gen_ai.response.finish_reasons": [finish],
                    "strata.fallback_reason": response.fallback_reason,
                    "strata.time_to_first_token_ms": timing.time_to_first_token_ms,
                    "strata.failover_at_token": response.failover_at_token,
                    **{f"strata.{stage}_ms": getattr(timing, f"{stage}_ms") for stage in STAGES},
                }
            )
            if self._content is not None:
                self.span.set_attributes({"gen_ai.prompt": self._content, "gen_ai.completion": response.text})
            self._end(self._arrival + timing.total_ms / 1000.0)
        fields = {
            "event": "request_finished",
            "request_id": response.request_id,
            "trace_id": self.trace_id,
            "tenant": self._tenant,
            "protocol": self._protocol,
            "model": response.model,
            "adapter": self._adapter,
            "input_tokens": response.usage.input_tokens,
            "output_tokens": response.usage.output_tokens,
            "cached_input_tokens": response.usage.cached_input_tokens,
            "draft_tokens": response.usage.draft_tokens,
            "accepted_draft_tokens": response.usage.accepted_draft_tokens,
            "finish_reason": finish,
            "fallback_reason": response.fallback_reason,
            "timing_ms": {field: round(getattr(timing, field), 3) for field in _TIMING_FIELDS},
            "forecast_ttft_ms": None if self._forecast_ms is None else round(self._forecast_ms, 3),
            "device_memory_bytes": device_memory_bytes,
        }
        if self._content is not None:
            fields.update(prompt=self._content, completion=response.text)
        log.info("request %s finished", response.request_id, extra={"fields": fields})

    def fail(self, request: gateway_pb2.GenerateRequest, request_id: str, error: GatewayError | None) -> None:
        """The request ended without a final response: an error status, or the client went away."""
        code = "cancelled" if error is None else error.code.name.lower()
        message = "the client cancelled or went away" if error is None else error.message
        if self.span is not None and not self._ended:
            self.span.set_attribute("error.type", code)
            self.span.set_status(Status(StatusCode.ERROR, message))
            self._end(time.perf_counter())
        suppressed = 0
        if error is not None and error.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            dropped = REFUSALS.take(self._tenant)
            if dropped is None:
                return
            suppressed = dropped
        fields = {
            "event": "request_failed",
            "request_id": request_id,
            "trace_id": self.trace_id,
            "tenant": self._tenant,
            "protocol": self._protocol,
            "model": request.model,
            "code": code,
            "error": message,
            "elapsed_ms": round((time.perf_counter() - self._arrival) * 1000.0, 3),
        }
        if suppressed:
            fields["suppressed"] = suppressed
        log.info("request %s failed: %s", request_id or "-", code, extra={"fields": fields})

    def _end(self, at: float) -> None:
        self._ended = True
        self._tracing.end(self.span, at)


def _content(request: gateway_pb2.GenerateRequest) -> str:
    """The request's text: its prompt, or its chat messages as `role: content` lines."""
    if len(request.messages):
        return "\n".join(f"{message.role}: {message.content}" for message in request.messages)
    return request.prompt


_TIMING_FIELDS = (
    "total_ms",
    "time_to_first_token_ms",
    "network_ms",
    "preprocess_ms",
    "queue_ms",
    "forward_ms",
    "decode_ms",
)
