"""One request's life in the gateway: validate, tokenize, admit, submit, stream deltas, summarize.

`Pipeline.run` is an async generator of Chunks: the text and ids of every step (coalesced when
several are queued), the last one carrying the final GenerateResponse with usage and the timing
breakdown. Closing it early (the client cancelled or went away) sends the worker a cancellation, so
the request's KV blocks are freed. Failures raise GatewayError for the servicer to turn into a
status. This module must not know gRPC servicer contexts: the servicer passes the deadline and trace
context in.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.validation import validate
from strata.v1 import common_pb2, gateway_pb2, tokenizer_pb2, worker_pb2

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Mapping

    from gateway.request_state import Delta
    from gateway.router import Router
    from gateway.settings import GatewaySettings
    from gateway.tokenize_batcher import TokenizeBatcher
    from gateway.validation import ValidRequest

TRACE_KEYS = ("traceparent", "tracestate")
_WIRE_SEQUENCE = itertools.count(1)


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What the pipeline needs from the incoming call."""

    deadline_unix_ms: int = 0
    """Absolute deadline; 0 is none."""
    trace_context: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Chunk:
    """New text and ids for the client; `final` on the last chunk only."""

    text: str
    token_ids: list[int]
    final: gateway_pb2.GenerateResponse | None = None


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


class Pipeline:
    """Runs requests through the tokenizer and a worker link."""

    def __init__(self, settings: GatewaySettings, router: Router, batcher: TokenizeBatcher) -> None:
        self._settings = settings
        self._router = router
        self._batcher = batcher

    async def run(self, request: gateway_pb2.GenerateRequest, call: CallInfo) -> AsyncGenerator[Chunk, None]:
        arrival = time.perf_counter()
        valid = validate(request, self._settings, self._router.max_model_len)
        limit = self._router.context_limit(valid.model)
        tokenized = await self._batcher.tokenize(
            tokenizer_pb2.TokenizeEntry(
                model=valid.model,
                prompt=request.prompt,
                messages=request.messages,
                max_input_tokens=limit - valid.sampling.max_new_tokens,
                truncation=request.truncation,
            )
        )
        preprocess_ms = ms_since(arrival)
        admitted_at = time.perf_counter()
        link = await self._router.admit(valid.model)
        admission_ms = ms_since(admitted_at)
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(valid.sampling)
        sampling.ClearField("stop")  # stop strings are matched here, not by the worker
        submission = worker_pb2.Submission(
            request_id=wire_id(valid),
            prompt_ids=tokenized.token_ids,
            sampling=sampling,
            deadline_unix_ms=call.deadline_unix_ms,
            trace_context=call.trace_context,
        )
        handle = link.submit(submission, valid.stop)
        summary = _Summary(valid, len(tokenized.token_ids), preprocess_ms, admission_ms)
        try:
            while True:
                deltas = [await handle.deltas.get()]
                while not handle.deltas.empty():
                    deltas.append(handle.deltas.get_nowait())
                chunk = summary.add(deltas, arrival)
                yield chunk
                if chunk.final is not None:
                    return
        finally:
            link.cancel(handle)  # a no-op once the request finished on the worker


def wire_id(valid: ValidRequest) -> str:
    """The id on the worker stream: unique there even when two callers choose the same request_id."""
    if not valid.caller_chose_id:
        return valid.request_id
    return f"{valid.request_id}#{next(_WIRE_SEQUENCE)}"


class _Summary:
    """Accumulates a request's deltas into its final response."""

    def __init__(
        self, valid: ValidRequest, input_tokens: int, preprocess_ms: float, admission_ms: float
    ) -> None:
        self.valid = valid
        self.input_tokens = input_tokens
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.timing = common_pb2.Timing(preprocess_ms=preprocess_ms)
        self.admission_ms = admission_ms
        self.first_update = True

    def add(self, deltas: list[Delta], arrival: float) -> Chunk:
        text: list[str] = []
        ids: list[int] = []
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        for delta in deltas:
            if delta.error is not None:
                raise delta.error
            if self.first_update:
                self.timing.queue_ms = self.admission_ms + delta.queue_ms
                self.first_update = False
            self.timing.forward_ms = max(self.timing.forward_ms, delta.forward_ms)
            self.timing.decode_ms += delta.decode_ms
            text.append(delta.text)
            ids.extend(delta.token_ids)
            finish = delta.finish_reason
        if ids and not self.token_ids:
            self.timing.time_to_first_token_ms = ms_since(arrival)
        chunk_text = "".join(text)
        self.text.append(chunk_text)
        self.token_ids.extend(ids)
        if finish == common_pb2.FINISH_REASON_UNSPECIFIED:
            return Chunk(chunk_text, ids)
        self.timing.total_ms = ms_since(arrival)
        final = gateway_pb2.GenerateResponse(
            text="".join(self.text),
            finish_reason=finish,
            usage=common_pb2.Usage(input_tokens=self.input_tokens, output_tokens=len(self.token_ids)),
            model=self.valid.model,
            fallback_reason="",
            timing=self.timing,
            request_id=self.valid.request_id,
            token_ids=self.token_ids,
        )
        return Chunk(chunk_text, ids, final)
