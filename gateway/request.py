"""One request in the gateway, from validation to its response: the one object that every step shares.

A Request holds the request's facts (the front door's Incoming, the validated request, its primary
route, fallback policy, priority and deadline), its trace and StageClock, the prompt ids as the
current route reads them, the detokenization state that the stateless tokenizer service needs (the
window of recent ids, the read offset inside it, the text held back as a possible stop-string prefix,
kept across attempts so that a failover's text continues exactly where the client's copy ends), and
the answer as it grows. Its current try is an Attempt (attempt.py). The worker link of the current
attempt feeds its deltas; the pipeline turns them into chunks here. A delta that reports a worker
failure (UNAVAILABLE: the stream broke, the worker refused or drained; or FINISH_REASON_ERROR from
the engine) ends the attempt: what came before it still reaches the client, and the Failure goes back
to the pipeline to recover from. Any other error is the request's own end and is raised. This module
must not do I/O nor choose where a request goes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway import tool_calls
from gateway.admission import Ticket, deadline_from_unix_ms, estimate_prompt_tokens, priority_of
from gateway.errors import DeadlineExceeded, TokenizerUnavailable, Unavailable
from gateway.fallback import FallbackPolicy
from gateway.logprobs import named, piece_ids
from gateway.metrics import INTER_TOKEN_LATENCY
from gateway.stage_clock import StageClock
from gateway.tenant_settings import DEFAULT_TENANT
from strata.v1 import common_pb2, gateway_pb2, tokenizer_pb2

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gateway.attempt import Attempt
    from gateway.errors import GatewayError
    from gateway.request_trace import RequestTrace
    from gateway.route import Route
    from gateway.stage_clock import Call
    from gateway.validation import ValidRequest
    from strata.v1 import worker_pb2

ENGINE_ERROR = "the worker's engine ended the request with FINISH_REASON_ERROR (such as out of memory)"


@dataclass(frozen=True, slots=True)
class Incoming:
    """A request as a front door (gRPC, HTTP) hands it to the pipeline; cancelling is closing the
    pipeline's generator."""

    request: gateway_pb2.GenerateRequest
    protocol: str = "grpc"
    tenant: str = DEFAULT_TENANT
    deadline_unix_ms: int = 0
    """Absolute deadline; 0 is none."""
    trace_context: Mapping[str, str] = field(default_factory=dict)
    """The caller's W3C trace context (traceparent, tracestate)."""


@dataclass(slots=True)
class Delta:
    """What one worker message meant for the request: new text and ids, and how it ended, if it did."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: common_pb2.FinishReason.ValueType = common_pb2.FINISH_REASON_UNSPECIFIED
    """Set on the attempt's last delta."""
    error: GatewayError | None = None
    """Set instead when the attempt failed; nothing follows it."""
    queue_ms: float = 0.0
    """The worker's queue time; on the attempt's first update."""
    forward_ms: float = 0.0
    """The worker's time from first scheduling to this update."""
    received: float = 0.0
    """time.perf_counter() when the worker's message with this update arrived."""
    detokenize: Call | None = None
    """The Detokenize call that turned this update into text."""
    device_memory_bytes: int = 0
    """The worker's device memory; on the last update."""
    cached_prompt_tokens: int = 0
    """Prompt tokens the worker's prefix cache served for this attempt."""
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    """Speculative decoding's drafts in the steps of this update, and those the model kept."""
    logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    """With sampling.logprobs: one entry per token of token_ids, tokens named."""
    prompt_logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    """With sampling.prompt_logprobs: on the attempt's first update."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """New text and ids for the client; `final` on the last chunk only."""

    text: str
    token_ids: list[int]
    final: gateway_pb2.GenerateResponse | None = None
    model: str = ""
    """The model serving the request when this chunk was made (a failover changes it mid-stream)."""
    logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    """With sampling.logprobs: one entry per token of token_ids."""
    index: int = 0
    """The sample this chunk belongs to (GenerateRequest.n; samples.py)."""
    sample_final: gateway_pb2.GenerateResponse | None = None
    """With n > 1: on each sample's last chunk, that sample's own final (`final` ends the request)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """A worker failed the request: the attempt is over, the request may not be."""

    reason: str
    worker_lost: bool = False
    """The worker went away or refused (UNAVAILABLE), rather than its engine failing the request."""


class Request:
    """One request's state in the gateway. Used from the event loop only."""

    def __init__(
        self, incoming: Incoming, valid: ValidRequest, primary: Route, trace: RequestTrace, arrival: float
    ) -> None:
        self.incoming = incoming
        self.valid = valid
        self.primary = primary
        self.policy = FallbackPolicy.of(primary, valid.request)
        self.priority = priority_of(valid.request.priority)
        self.deadline = deadline_from_unix_ms(incoming.deadline_unix_ms)
        """time.monotonic() deadline; None when the call has none."""
        self.trace = trace
        self.arrival = arrival
        self.clock = StageClock(arrival)
        self.prompt_ids: list[int] = []
        """The prompt as the current route reads it; empty until tokenized."""
        self.attempt: Attempt | None = None
        self.deltas: asyncio.Queue[Delta] = asyncio.Queue()
        """Fed by the current attempt's worker link."""
        self.window: list[int] = []
        self.read_offset = 0
        self.pending_text = ""
        self.token_ids: list[int] = []
        self.detokenized_tokens = 0
        """Ids sent to the detokenizer so far: min_tokens holds stop strings back until it is reached."""
        self.logprobs: list[common_pb2.PositionLogprobs] = []
        self.prompt_logprobs: list[common_pb2.PositionLogprobs] = []
        self.text: list[str] = []
        self.timing = common_pb2.Timing()
        self.model = valid.model
        self.fallback_reason = ""
        self.failover_at_token = 0
        self.device_memory_bytes = 0
        self.cached_input_tokens = 0
        """Prompt tokens the serving attempt's worker took from its prefix cache."""
        self.draft_tokens = 0
        self.accepted_draft_tokens = 0
        """Speculative decoding's drafts for the request on every attempt, and those kept."""
        self._last_chunk = arrival

    @property
    def input_tokens(self) -> int:
        return len(self.prompt_ids)

    def ticket(self) -> Ticket:
        """What admission knows of the request now: a continuation counts the tokens already sent."""
        sent = len(self.token_ids)
        prompt = len(self.prompt_ids) if self.prompt_ids else estimate_prompt_tokens(self.valid.request)
        return Ticket(
            request_id=self.valid.request_id,
            prompt_tokens=prompt + sent,
            max_new_tokens=self.valid.sampling.max_new_tokens - sent,
            priority=self.priority,
            deadline=self.deadline,
            tenant=self.incoming.tenant,
        )

    # The worker link's side: one Detokenize entry per update, and the delta it makes.

    def entry(self, update: worker_pb2.TokenUpdate) -> tokenizer_pb2.DetokenizeEntry:
        """The Detokenize entry for this update's new ids (and the ids its log probabilities name)."""
        reached = self.detokenized_tokens + len(update.token_ids) >= self.valid.sampling.min_tokens
        return tokenizer_pb2.DetokenizeEntry(
            model=self.model,
            window=self.window,
            read_offset=self.read_offset,
            new_ids=update.token_ids,
            pending_text=self.pending_text,
            stop=self.valid.stop if reached else (),
            final=update.finished,
            piece_ids=piece_ids([*update.logprobs, *update.prompt_logprobs]),
        )

    def deliver(
        self,
        update: worker_pb2.TokenUpdate,
        result: tokenizer_pb2.DetokenizeResult,
        received: float,
        detokenize: Call,
    ) -> None:
        """Keep the result's state for the next entry and queue the client's delta.

        A stop string ends the request with FINISH_REASON_STOP even if the worker has not finished it;
        the text stops where the stop string begins, while token_ids keep every id of this update.
        """
        self.window = list(result.window)
        self.read_offset = result.read_offset
        self.pending_text = result.pending_text
        self.detokenized_tokens += len(update.token_ids)
        pieces = iter(result.pieces)
        finish = update.finish_reason if update.finished else common_pb2.FINISH_REASON_UNSPECIFIED
        if result.stopped:
            finish = common_pb2.FINISH_REASON_STOP
        self.deltas.put_nowait(
            Delta(
                text=result.text,
                token_ids=list(update.token_ids),
                finish_reason=finish,
                queue_ms=update.queue_ms,
                forward_ms=update.forward_ms,
                received=received,
                detokenize=detokenize,
                device_memory_bytes=update.device_memory_bytes,
                cached_prompt_tokens=update.cached_prompt_tokens,
                draft_tokens=update.draft_tokens,
                accepted_draft_tokens=update.accepted_draft_tokens,
                logprobs=named(update.logprobs, pieces),
                prompt_logprobs=named(update.prompt_logprobs, pieces),
            )
        )

    def fail(self, error: GatewayError) -> None:
        """The current attempt failed; nothing of it follows."""
        self.deltas.put_nowait(Delta(error=error))

    # The pipeline's side: deltas into chunks, and the final response.

    async def next_deltas(self) -> list[Delta]:
        """The next delta, and every other one already queued (coalesced into one chunk)."""
        deltas = [await self.deltas.get()]
        while not self.deltas.empty():
            deltas.append(self.deltas.get_nowait())
        return deltas

    def add(self, deltas: list[Delta]) -> tuple[Chunk | None, Failure | None]:
        """The chunk these deltas make (None when they carry nothing) and the failure that ended them."""
        attempt = self.attempt
        assert attempt is not None
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[common_pb2.PositionLogprobs] = []
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        failure: Failure | None = None
        for delta in deltas:
            if delta.error is not None:
                if not isinstance(delta.error, Unavailable) or isinstance(delta.error, TokenizerUnavailable):
                    raise delta.error
                failure = Failure(delta.error.message, worker_lost=True)
                break
            if delta.token_ids or delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                attempt.took(delta)
                # Every update carries it; a failover's attempt replaces what the lost one reported.
                self.cached_input_tokens = delta.cached_prompt_tokens
                # Per update, so a lost attempt's drafts stay counted: they were scored.
                self.draft_tokens += delta.draft_tokens
                self.accepted_draft_tokens += delta.accepted_draft_tokens
                if delta.device_memory_bytes:
                    self.device_memory_bytes = delta.device_memory_bytes
            text.append(delta.text)
            ids.extend(delta.token_ids)
            logprobs.extend(delta.logprobs)
            if delta.prompt_logprobs and not self.prompt_logprobs:
                # A failover's prompt holds the prior output too: only the client's prompt is kept.
                self.prompt_logprobs = delta.prompt_logprobs[: max(0, self.input_tokens - 1)]
            if delta.finish_reason == common_pb2.FINISH_REASON_ERROR:
                failure = Failure(ENGINE_ERROR)
                break
            if delta.finish_reason == common_pb2.FINISH_REASON_CANCELLED:
                # The gateway stops reading a request it cancels, so the worker ended this one on its own:
                # its deadline passed there first (the client's own deadline fires a moment later).
                received = len(self.token_ids) + len(ids)
                raise DeadlineExceeded(f"the request's deadline passed after {received} generated tokens")
            finish = delta.finish_reason
        if failure is not None:
            attempt.end()
        if ids:
            self._chunk_sent(len(ids))
        chunk_text = "".join(text)
        self.text.append(chunk_text)
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        if finish != common_pb2.FINISH_REASON_UNSPECIFIED:
            attempt.end()
            final = self._final(finish)
            self.trace.finish(final, self.device_memory_bytes)
            return Chunk(chunk_text, ids, final, self.model, logprobs), None
        if not ids and not chunk_text:
            return None, failure
        return Chunk(chunk_text, ids, model=self.model, logprobs=logprobs), failure

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
        parts = self.clock.milliseconds()
        self.timing.total_ms = (self.clock.cursor - self.arrival) * 1000.0
        self.timing.network_ms = parts["network"]
        self.timing.preprocess_ms = parts["preprocess"]
        self.timing.queue_ms = parts["queue"]
        self.timing.forward_ms = parts["forward"]
        self.timing.decode_ms = parts["decode"]
        text = "".join(self.text)
        stopped = finish == common_pb2.FINISH_REASON_STOP
        return gateway_pb2.GenerateResponse(
            text=text,
            finish_reason=finish,
            usage=common_pb2.Usage(
                input_tokens=self.input_tokens,
                output_tokens=len(self.token_ids),
                cached_input_tokens=self.cached_input_tokens,
                draft_tokens=self.draft_tokens,
                accepted_draft_tokens=self.accepted_draft_tokens,
            ),
            model=self.model,
            fallback_reason=self.fallback_reason,
            timing=self.timing,
            request_id=self.valid.request_id,
            token_ids=self.token_ids,
            failover_at_token=self.failover_at_token,
            trace_id=self.trace.trace_id,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            tool_calls=tool_calls.parse(self.valid.request, text) if stopped else [],
        )
