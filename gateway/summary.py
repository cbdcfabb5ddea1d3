"""A request's answer as it grows: the client's chunks, its final GenerateResponse, and the worker
failures that end an attempt.

The pipeline feeds it the deltas of each attempt (the primary's, then the fallback's after a detour or
a failover). A delta that reports a worker failure (UNAVAILABLE: the stream broke, the worker refused
or drained; or FINISH_REASON_ERROR from the engine) ends the batch: what came before it still reaches
the client, and the failure goes back to the pipeline to recover from. Any other error is the
request's own end and is raised. This module must not do I/O nor choose where a request goes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gateway.errors import DeadlineExceeded, TokenizerUnavailable, Unavailable
from gateway.metrics import INTER_TOKEN_LATENCY
from gateway.stage_clock import StageClock, WorkerAttempt
from strata.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from gateway.request_state import Delta
    from gateway.validation import ValidRequest

ENGINE_ERROR = "the worker's engine ended the request with FINISH_REASON_ERROR (such as out of memory)"


@dataclass(frozen=True, slots=True)
class Chunk:
    """New text and ids for the client; `final` on the last chunk only."""

    text: str
    token_ids: list[int]
    final: gateway_pb2.GenerateResponse | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """A worker failed the request: the attempt is over, the request may not be."""

    reason: str
    worker_lost: bool = False
    """The worker went away or refused (UNAVAILABLE), rather than its engine failing the request."""


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


class Summary:
    """Accumulates a request's deltas, across attempts, into chunks and its final response.

    Its StageClock splits the request's time; the pipeline moves it up to each submission, and the
    deltas of each attempt close that attempt's part (see stage_clock.py).
    """

    def __init__(self, valid: ValidRequest, arrival: float) -> None:
        self.valid = valid
        self.arrival = arrival
        self.clock = StageClock(arrival)
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.timing = common_pb2.Timing()
        self.model = valid.model
        self.input_tokens = 0
        self.fallback_reason = ""
        self.failover_at_token = 0
        self.device_memory_bytes = 0
        self._attempt: WorkerAttempt | None = None
        self.ended_attempt: WorkerAttempt | None = None
        """The last attempt that ended, as the clock was given it."""
        self._last_chunk = arrival

    def serve(self, model: str, input_tokens: int, submitted: float, fallback_reason: str = "") -> None:
        """A new attempt: who serves it, its prompt's length, when it was sent to the worker."""
        self.model = model
        self.input_tokens = input_tokens
        self._attempt = WorkerAttempt(submitted=submitted, ended=submitted)
        if fallback_reason:
            self.fallback_reason = fallback_reason

    def end_attempt(self) -> None:
        """The current attempt is over (finished or failed): give its time to the clock's stages."""
        if self._attempt is not None:
            self.ended_attempt = replace(self._attempt, ended=time.perf_counter())
            self.clock.worker_attempt(self.ended_attempt)
            self._attempt = None

    def add(self, deltas: list[Delta]) -> tuple[Chunk | None, Failure | None]:
        """The chunk these deltas make (None when they carry nothing) and the failure that ended them."""
        text: list[str] = []
        ids: list[int] = []
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        failure: Failure | None = None
        for delta in deltas:
            if delta.error is not None:
                if not isinstance(delta.error, Unavailable) or isinstance(delta.error, TokenizerUnavailable):
                    raise delta.error
                failure = Failure(delta.error.message, worker_lost=True)
                self.end_attempt()
                break
            if delta.token_ids or delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                self._time(delta)
            text.append(delta.text)
            ids.extend(delta.token_ids)
            if delta.finish_reason == common_pb2.FINISH_REASON_ERROR:
                failure = Failure(ENGINE_ERROR)
                self.end_attempt()
                break
            if delta.finish_reason == common_pb2.FINISH_REASON_CANCELLED:
                # The gateway stops reading a request it cancels, so the worker ended this one on its own:
                # its deadline passed there first (the client's own deadline fires a moment later).
                received = len(self.token_ids) + len(ids)
                raise DeadlineExceeded(f"the request's deadline passed after {received} generated tokens")
            finish = delta.finish_reason
        if ids:
            self._chunk_sent(len(ids))
        chunk_text = "".join(text)
        self.text.append(chunk_text)
        self.token_ids.extend(ids)
        if finish != common_pb2.FINISH_REASON_UNSPECIFIED:
            return Chunk(chunk_text, ids, self._final(finish)), None
        if not ids and not chunk_text:
            return None, failure
        return Chunk(chunk_text, ids), failure

    def _time(self, delta: Delta) -> None:
        """Keep what the attempt's part needs: the last update's arrival, worker time and decode call."""
        attempt = self._attempt
        if attempt is None:
            return
        first = attempt.received is None
        queue_ms = delta.queue_ms if first else attempt.worker_queue_ms
        self._attempt = replace(
            attempt,
            received=delta.received,
            worker_queue_ms=queue_ms,
            worker_ms=queue_ms + delta.forward_ms,
            detokenize=delta.detokenize,
        )
        if delta.device_memory_bytes:
            self.device_memory_bytes = delta.device_memory_bytes

    def _chunk_sent(self, tokens: int) -> None:
        now = time.perf_counter()
        if not self.token_ids:
            self.timing.time_to_first_token_ms = (now - self.arrival) * 1000.0
        else:
            gap = (now - self._last_chunk) / tokens
            child = INTER_TOKEN_LATENCY.labels(self.model)
            for _ in range(tokens):
                child.observe(gap)
        self._last_chunk = now

    def _final(self, finish: common_pb2.FinishReason.ValueType) -> gateway_pb2.GenerateResponse:
        self.end_attempt()
        parts = self.clock.milliseconds()
        self.timing.total_ms = (self.clock.cursor - self.arrival) * 1000.0
        self.timing.network_ms = parts["network"]
        self.timing.preprocess_ms = parts["preprocess"]
        self.timing.queue_ms = parts["queue"]
        self.timing.forward_ms = parts["forward"]
        self.timing.decode_ms = parts["decode"]
        return gateway_pb2.GenerateResponse(
            text="".join(self.text),
            finish_reason=finish,
            usage=common_pb2.Usage(input_tokens=self.input_tokens, output_tokens=len(self.token_ids)),
            model=self.model,
            fallback_reason=self.fallback_reason,
            timing=self.timing,
            request_id=self.valid.request_id,
            token_ids=self.token_ids,
            failover_at_token=self.failover_at_token,
        )
