"""The requests one Connect stream accepted and the engine runs: their records, deadlines and ends.

OpenRequests keys each AcceptedRequest by the gateway's request id, arms its deadline, and ends it
exactly once: at its last step output (`collect`), when aborted (a cancellation, a passed deadline, a
drain, the stream ending) or when the engine fails it. Every end gives the request's credit back to
the host and closes its trace spans. Timing is measured on the event loop: queue_ms runs from arrival
to the start of the first step that produced a token for the request, so with a prompt prefilled in
several chunks the earlier chunks count as queueing; forward_ms runs from that step's start to the end
of the step that produced the update. This module builds the TokenUpdates that describe its requests
but must not write them to the stream (connection.py does), read submissions, nor choose status codes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from services.worker.convert import ended_update, token_update
from services.worker.engine.sequence import FinishReason

if TYPE_CHECKING:
    from collections.abc import Callable

    from services.worker.engine.async_engine import StepReport
    from services.worker.engine.sequence import StepOutput
    from services.worker.request_spans import RequestSpans, WorkerSpans
    from strata.v1 import worker_pb2

log = logging.getLogger(__name__)


class RequestHost(Protocol):
    """What OpenRequests needs of the worker that runs its requests (host.py's WorkerHost)."""

    @property
    def spans(self) -> WorkerSpans: ...

    def abort(self, engine_id: str) -> None:
        """Abort an accepted request in the engine; its credit comes back through `finished`."""

    def finished(self, engine_id: str) -> None:
        """An accepted request ended in the engine: give its credit back."""

    def device_memory_bytes(self) -> int: ...


@dataclass(slots=True)
class AcceptedRequest:
    """A request accepted on this stream and not yet finished."""

    request_id: str
    engine_id: str
    prompt_tokens: int
    """The submission's prompt_ids, without any prior output."""
    prior_tokens: int
    """prior_output_ids of a failover: prefilled by the engine, counted as output, never sent back."""
    submitted: float
    """time.monotonic() at arrival."""
    first_step: float | None = None
    """time.monotonic() at the start of the first step that produced one of its tokens."""
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens the prefix cache served, as the engine's updates report them."""
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    """Speculative decoding's drafts for it, and those kept, for its forward span."""
    deadline: asyncio.TimerHandle | None = None
    spans: RequestSpans | None = None
    """Its trace state; None when untraced."""

    def forward_ms(self, now: float) -> float:
        return 0.0 if self.first_step is None else (now - self.first_step) * 1000.0


class OpenRequests:
    """The open requests of one stream, by request id. Used from the event loop only."""

    def __init__(
        self, host: RequestHost, prefix: str, expired: Callable[[worker_pb2.TokenUpdate], None]
    ) -> None:
        """`prefix` starts every engine id of the stream; `expired` sends the update of a request
        whose deadline passed while it ran."""
        self._host = host
        self._prefix = prefix
        self._expired = expired
        self._open: dict[str, AcceptedRequest] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def add(self, record: AcceptedRequest, left_s: float | None) -> None:
        """Hold a request the host accepted; it is aborted after `left_s` seconds unless None."""
        if left_s is not None:
            record.deadline = asyncio.get_running_loop().call_later(left_s, self._expire, record.request_id)
        self._open[record.request_id] = record

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORTED) -> worker_pb2.TokenUpdate:
        """Abort a running request (its KV blocks are free before the next step) and say so."""
        record = self._open[request_id]
        self._host.abort(record.engine_id)
        self._forget(record, reason.value, f"the worker ended the request: {reason.value}")
        return ended_update(
            record.request_id,
            reason,
            prompt_tokens=record.prompt_tokens,
            output_tokens=record.output_tokens,
            forward_ms=record.forward_ms(time.monotonic()),
        )

    def abort_all(self, reason: FinishReason) -> list[worker_pb2.TokenUpdate]:
        return [self.abort(request_id, reason) for request_id in list(self._open)]

    def discard_all(self, error: str) -> None:
        """Abort every request with no update to send: the stream that would carry it is gone."""
        for record in list(self._open.values()):
            self._host.abort(record.engine_id)
            self._forget(record, "aborted", error)

    def collect(self, outputs: list[StepOutput], report: StepReport) -> list[worker_pb2.TokenUpdate]:
        """These requests' updates from one step; finished requests give their credits back here."""
        updates = []
        for out in outputs:
            record = self._record(out.request_id)
            if record is None:
                continue
            queue_ms = 0.0
            if record.first_step is None:
                record.first_step = report.started
                queue_ms = max(0.0, report.started - record.submitted) * 1000.0
            record.output_tokens = out.num_output_tokens + record.prior_tokens
            record.draft_tokens += out.num_drafted
            record.accepted_draft_tokens += out.num_accepted
            self._host.spans.join(record.spans)
            forward_ms = record.forward_ms(report.ended)
            update = token_update(
                record.request_id,
                out,
                queue_ms=queue_ms,
                forward_ms=forward_ms,
                prior_tokens=record.prior_tokens,
            )
            record.cached_prompt_tokens = update.cached_prompt_tokens
            updates.append(update)
            if out.finished:
                update.device_memory_bytes = self._host.device_memory_bytes()
                reason = out.finish_reason.value if out.finish_reason is not None else "stop"
                self._forget(record, reason, ended=report.ended)
        return updates

    def fail(self, engine_id: str, error: BaseException) -> worker_pb2.TokenUpdate | None:
        """The engine could not add the request, or died with it in; None when it is not open here."""
        record = self._record(engine_id)
        if record is None:
            return None
        self._forget(record, "error", f"the engine could not run the request: {error}")
        log.error("request %s failed in the engine: %r", record.request_id, error)
        return ended_update(
            record.request_id,
            FinishReason.ERROR,
            prompt_tokens=record.prompt_tokens,
            output_tokens=record.output_tokens,
            forward_ms=record.forward_ms(time.monotonic()),
        )

    def _expire(self, request_id: str) -> None:
        if request_id in self._open:
            log.info("request %s passed its deadline while running: cancelled", request_id)
            self._expired(self.abort(request_id))

    def _record(self, engine_id: str) -> AcceptedRequest | None:
        record = self._open.get(engine_id.removeprefix(self._prefix))
        return record if record is not None and record.engine_id == engine_id else None

    def _forget(
        self, record: AcceptedRequest, finish_reason: str, error: str = "", ended: float | None = None
    ) -> None:
        if record.deadline is not None:
            record.deadline.cancel()
        del self._open[record.request_id]
        self._host.finished(record.engine_id)
        self._host.spans.finish(
            record.spans,
            submitted=record.submitted,
            first_step=record.first_step,
            ended=time.monotonic() if ended is None else ended,
            output_tokens=record.output_tokens,
            finish_reason=finish_reason,
            error=error,
            cached_prompt_tokens=record.cached_prompt_tokens,
            draft_tokens=record.draft_tokens,
            accepted_draft_tokens=record.accepted_draft_tokens,
        )
