"""One request in the gateway, from validation to its response: the one object that every step shares.

A Request holds the request's facts (the front door's Incoming, the validated request, its primary
route, fallback policy, priority and deadline, its prompt's piece hashes for the forecast's guess of
what a worker has cached), its trace and StageClock, the prompt ids as the current route reads
them, its DeltaSink (delta_sink.py: where the worker link of its current attempt
puts its deltas, with the detokenization state kept across attempts), and the answer as it grows.
The pipeline, its one owner, changes it: it names the route an attempt is sent on (`sent_to`) and
turns the deltas into chunks (`add`). A delta that reports a worker failure (UNAVAILABLE: the stream
broke, the worker refused or drained; or FINISH_REASON_ERROR from the engine) ends the attempt: what
came before it still reaches the client, and the Failure goes back to the pipeline to recover from.
Any other error is the request's own end and is raised. This module must not do I/O, choose where a
request goes, nor know its attempts (attempt.py keeps each one's part).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gateway import tool_calls
from gateway.adapter_names import ModelName
from gateway.admission import Ticket, deadline_from_unix_ms, estimate_prompt_tokens, priority_of
from gateway.delta_sink import DeltaSink
from gateway.errors import DeadlineExceeded, TokenizerUnavailable, Unavailable
from gateway.fallback import FallbackPolicy
from gateway.metrics import INTER_TOKEN_LATENCY
from gateway.prompt_prefix import prompt_prefix
from gateway.request_values import Chunk, Delta, Failure
from gateway.stage_clock import StageClock
from strata.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from gateway.fallback import Detour
    from gateway.request_trace import RequestTrace
    from gateway.request_values import Incoming
    from gateway.route import Route
    from gateway.validation import ValidRequest

ENGINE_ERROR = "the worker's engine ended the request with FINISH_REASON_ERROR (such as out of memory)"


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
        # A worker keeps each tenant's, and each adapter's, cached blocks apart: so does the guess.
        salt = f"{incoming.tenant}\0{valid.adapter}" if valid.adapter else incoming.tenant
        self.prefix = prompt_prefix(valid.request, salt)
        """The prompt's piece hashes, for the forecast's guess of what a worker has cached."""
        self.sink = DeltaSink(valid.stop, valid.sampling.min_tokens)
        """Fed by the current attempt's worker link; read by the pipeline."""
        self.token_ids: list[int] = []
        self.logprobs: list[common_pb2.PositionLogprobs] = []
        self.prompt_logprobs: list[common_pb2.PositionLogprobs] = []
        self.text: list[str] = []
        self.timing = common_pb2.Timing()
        self.model = ModelName(valid.model, valid.adapter).served
        """The model that serves it, as responses, logs and metrics name it."""
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
            prefix=self.prefix,
        )

    def adapter_on(self, route: Route) -> str:
        """The LoRA adapter an attempt on `route` runs through: the request's, on its primary and on a
        fallback, unless the primary's route runs adapters' requests on the fallback's base model."""
        if route is self.primary or not self.primary.settings.adapter_fallback_to_base:
            return self.valid.adapter
        return ""

    def sent_to(self, route: Route, detour: Detour | None) -> None:
        """An attempt is sent to `route` (`detour`: why not the primary, None on it): the response
        names the model that serves it (`<route>:<adapter>` through an adapter), the first detour's
        reason, and where a failover took the stream over."""
        if detour is not None and not self.fallback_reason:
            self.fallback_reason = detour.reason
        if self.token_ids:
            self.failover_at_token = len(self.token_ids)
        self.model = ModelName(route.name, self.adapter_on(route)).served

    def add(self, deltas: list[Delta]) -> tuple[Chunk | None, Failure | None]:
        """The chunk these deltas make (None when they carry nothing) and the failure that ended them.
        The attempt that sent them recorded its part of them first (Attempt.record)."""
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[common_pb2.PositionLogprobs] = []
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        stop_sequence = ""
        failure: Failure | None = None
        for delta in deltas:
            if delta.error is not None:
                if not isinstance(delta.error, Unavailable) or isinstance(delta.error, TokenizerUnavailable):
                    raise delta.error
                failure = Failure(delta.error.message, worker_lost=True)
                break
            if delta.from_worker:
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
            # From the delta that ended the text, whichever attempt sent it.
            stop_sequence = delta.stop_sequence
        if ids:
            self._chunk_sent(len(ids))
        chunk_text = "".join(text)
        self.text.append(chunk_text)
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        if finish != common_pb2.FINISH_REASON_UNSPECIFIED:
            final = self._final(finish, stop_sequence)
            self.trace.finish(final, self.device_memory_bytes)
            return self._chunk(chunk_text, ids, logprobs, final), None
        if not ids and not chunk_text:
            return None, failure
        return self._chunk(chunk_text, ids, logprobs), failure

    def _chunk(
        self,
        text: str,
        ids: list[int],
        logprobs: list[common_pb2.PositionLogprobs],
        final: gateway_pb2.GenerateResponse | None = None,
    ) -> Chunk:
        """A chunk for the client: its text and ids, the serving model, and the prompt's counts."""
        return Chunk(
            text,
            ids,
            final,
            self.model,
            logprobs,
            input_tokens=self.input_tokens,
            cached_input_tokens=self.cached_input_tokens,
        )

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

    def _final(
        self, finish: common_pb2.FinishReason.ValueType, stop_sequence: str
    ) -> gateway_pb2.GenerateResponse:
        parts = self.clock.milliseconds()
        self.timing.total_ms = (self.clock.cursor - self.arrival) * 1000.0
        self.timing.network_ms = parts["network"]
        self.timing.preprocess_ms = parts["preprocess"]
        self.timing.queue_ms = parts["queue"]
        self.timing.forward_ms = parts["forward"]
        self.timing.decode_ms = parts["decode"]
        text = "".join(self.text)
        # A cut answer keeps its whole calls (tool_calls.parse drops the cut one); a cancelled or
        # failed one has none.
        answered = finish in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
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
            tool_calls=tool_calls.parse(self.valid.request, text, self.valid.request_id) if answered else [],
            stop_sequence=stop_sequence,
        )
