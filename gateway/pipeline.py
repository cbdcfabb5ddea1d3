"""One request's life in the gateway: validate, choose a route, queue, tokenize, submit, stream deltas,
recover from a failing worker, summarize.

`Pipeline.run` is an async generator of Chunks: the text and ids of every step (coalesced when
several are queued), the last one carrying the final GenerateResponse with usage, the timing
breakdown, the model that served it and why that was a fallback. The route is chosen and the request
queued before anything is awaited, so an overloaded route refuses at once; the prompt is tokenized
while the request waits for a worker credit. gateway.fallback decides the detours: a primary that is
unavailable or (for `allow_fallback`) saturated sends the request to its fallback; once submitted, a
worker failure before the first token is retried there, and one mid-stream continues there from the
tokens the client already holds (`prior_output_ids`, with the detokenization state carried over so
no text repeats). Closing the generator early (the client cancelled or went away) sends the worker a
cancellation, so the request's KV blocks are freed. Failures raise GatewayError for the servicer to
turn into a status. This module must not know gRPC servicer contexts (the servicer passes the
deadline and trace context in) nor decide admission (router.py does).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.admission import (
    Priority,
    Refused,
    Ticket,
    deadline_from_unix_ms,
    estimate_prompt_tokens,
    priority_of,
)
from gateway.errors import GatewayError, ResourceExhausted, Unavailable
from gateway.fallback import Detour, FallbackPolicy, received
from gateway.metrics import FALLBACKS
from gateway.request_state import Delta, OpenRequest
from gateway.summary import Chunk, Failure, Summary, ms_since
from gateway.validation import validate
from strata.v1 import common_pb2, tokenizer_pb2, worker_pb2

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Callable, Mapping

    from gateway.route import Route
    from gateway.router import Router
    from gateway.settings import GatewaySettings
    from gateway.tokenize_batcher import TokenizeBatcher
    from gateway.validation import ValidRequest
    from gateway.worker_link import WorkerLink
    from strata.v1 import gateway_pb2

__all__ = ["TRACE_KEYS", "CallInfo", "Chunk", "Pipeline", "wire_id"]

TRACE_KEYS = ("traceparent", "tracestate")
_WIRE_SEQUENCE = itertools.count(1)


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What the pipeline needs from the incoming call."""

    deadline_unix_ms: int = 0
    """Absolute deadline; 0 is none."""
    trace_context: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Job:
    """One request's facts that every attempt shares."""

    valid: ValidRequest
    call: CallInfo
    primary: Route
    policy: FallbackPolicy
    priority: Priority
    deadline: float | None
    """time.monotonic() deadline; None when the call has none."""

    def ticket(self, prompt_tokens: int, prior_tokens: int = 0) -> Ticket:
        return Ticket(
            request_id=self.valid.request_id,
            prompt_tokens=prompt_tokens + prior_tokens,
            max_new_tokens=self.valid.sampling.max_new_tokens - prior_tokens,
            priority=self.priority,
            deadline=self.deadline,
        )


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One submission of the request: where it runs and what it was sent."""

    route: Route
    link: WorkerLink | None
    """None when the submission failed at once (its failure waits on `handle`)."""
    handle: OpenRequest
    prompt_ids: list[int]
    detour: Detour | None


class Pipeline:
    """Runs requests through the tokenizer and a worker link of the route (or of its fallback)."""

    def __init__(
        self,
        settings: GatewaySettings,
        router: Router,
        batcher: TokenizeBatcher,
        fingerprint: Callable[[str], str],
    ) -> None:
        """`fingerprint(model)` is the tokenizer fingerprint of a route's model ("" when unknown)."""
        self._settings = settings
        self._router = router
        self._batcher = batcher
        self._fingerprint = fingerprint

    async def run(self, request: gateway_pb2.GenerateRequest, call: CallInfo) -> AsyncGenerator[Chunk, None]:
        arrival = time.perf_counter()
        valid = validate(request, self._settings, self._router.max_model_len)
        primary = self._router.route(valid.model)
        job = _Job(
            valid=valid,
            call=call,
            primary=primary,
            policy=FallbackPolicy.of(primary, request),
            priority=priority_of(request.priority),
            deadline=deadline_from_unix_ms(call.deadline_unix_ms),
        )
        summary = Summary(valid, arrival, 0.0)
        ticket = job.ticket(estimate_prompt_tokens(request))
        route, detour = self._choose(job, ticket)
        attempt = await self._attempt(job, summary, route, detour, ticket)
        attempts = [attempt]
        try:
            while True:
                handle = attempt.handle
                deltas = [await handle.deltas.get()]
                while not handle.deltas.empty():
                    deltas.append(handle.deltas.get_nowait())
                chunk, failure = summary.add(deltas)
                if chunk is not None:
                    yield chunk
                    if chunk.final is not None:
                        return
                if failure is not None:
                    attempt = await self._recover(job, attempt, failure, summary)
                    attempts.append(attempt)
        finally:
            for each in attempts:
                if each.link is not None:
                    each.link.cancel(each.handle)  # a no-op once the request finished on the worker

    def _choose(self, job: _Job, ticket: Ticket) -> tuple[Route, Detour | None]:
        """The first route to queue on, decided at once: the primary unless it is down or saturated."""
        primary, fallback = job.primary, self._fallback(job)
        if fallback is None:
            return primary, None
        if not primary.available():
            reason = primary.unavailable_reason()
            return fallback, job.policy.when_unavailable(
                reason, fallback.available(), fallback.unavailable_reason()
            )
        saturation = primary.saturation(ticket)
        if saturation is not None:
            detour = job.policy.when_saturated(saturation, self._free(fallback, ticket))
            if detour is not None:
                return fallback, detour
        return primary, None

    def _fallback(self, job: _Job) -> Route | None:
        """The fallback route when this request may use it at all."""
        return self._router.route(job.policy.fallback) if job.policy.usable else None

    @staticmethod
    def _free(route: Route, ticket: Ticket) -> bool:
        return route.available() and route.saturation(ticket) is None

    async def _attempt(
        self,
        job: _Job,
        summary: Summary,
        route: Route,
        detour: Detour | None,
        ticket: Ticket,
        prompt: list[int] | None = None,
        previous: OpenRequest | None = None,
    ) -> _Attempt:
        """Queue on `route` (refusals are raised at once), tokenize while waiting, submit.

        `previous` is the handle of a stream that failed mid-way: its tokens become prior_output_ids and
        its detokenization state carries over. When the queue lets the request go before a worker took
        it (a shed batch request, or the route lost every worker), the primary's request moves on to the
        fallback if the policy allows.
        """
        admission = route.enqueue(ticket)
        with admission:
            if prompt is None or not self._fits(job, route, len(prompt)):
                prompt = await self._tokenize(job, route, summary)
            waited = time.perf_counter()
            try:
                link = await admission.granted(ticket.prompt_tokens if previous else len(prompt))
            except (Refused, Unavailable) as error:
                lost: GatewayError = error
            else:
                link = admission.hand_over()
                summary.serve(route.name, len(prompt), ms_since(waited), detour.reason if detour else "")
                return self._submit(job, route, link, prompt, detour, summary, previous)
        route, detour = self._requeue(job, route, lost, ticket)
        return await self._attempt(job, summary, route, detour, ticket, prompt, previous)

    def _requeue(self, job: _Job, route: Route, lost: GatewayError, ticket: Ticket) -> tuple[Route, Detour]:
        """Where a request the primary's queue let go goes next; raises `lost` when nowhere."""
        fallback = self._fallback(job)
        if route is not job.primary or fallback is None:
            raise lost
        if isinstance(lost, Refused):
            detour = job.policy.when_saturated(lost.message, self._free(fallback, ticket))
            if detour is None:
                raise lost
            return fallback, detour
        return fallback, job.policy.when_unavailable(
            lost.message, fallback.available(), fallback.unavailable_reason()
        )

    def _submit(
        self,
        job: _Job,
        route: Route,
        link: WorkerLink,
        prompt: list[int],
        detour: Detour | None,
        summary: Summary,
        previous: OpenRequest | None,
    ) -> _Attempt:
        prior = list(summary.token_ids) if previous is not None else []
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(job.valid.sampling)
        sampling.ClearField("stop")  # stop strings are matched here, not by the worker
        submission = worker_pb2.Submission(
            request_id=wire_id(job.valid),
            prompt_ids=prompt,
            sampling=sampling,
            deadline_unix_ms=job.call.deadline_unix_ms,
            trace_context=job.call.trace_context,
            priority=job.priority.worker_priority,
            prior_output_ids=prior,
        )
        try:
            handle = link.submit(submission, job.valid.stop)
        except Unavailable as error:  # the link broke between the grant and now: fail this attempt
            handle = OpenRequest(submission.request_id, route.name, job.valid.stop)
            handle.deltas.put_nowait(Delta(error=error))
            return _Attempt(route, None, handle, prompt, detour)
        if previous is not None:
            handle.resume(previous)  # before any update of the new stream is read: same event-loop tick
            summary.failover_at_token = len(prior)
        if detour is not None:
            FALLBACKS.labels(route=job.primary.name, reason=detour.trigger.value).inc()
        return _Attempt(route, link, handle, prompt, detour)

    async def _recover(self, job: _Job, attempt: _Attempt, failure: Failure, summary: Summary) -> _Attempt:
        """The next attempt after a worker failed this one, or the Unavailable that ends the request."""
        count = len(summary.token_ids)
        if attempt.detour is not None:
            raise Unavailable(
                f"fallback model {attempt.route.name!r} failed the request too: {failure.reason} "
                f"(it served model {job.primary.name!r} because: {attempt.detour.reason}); {received(count)}"
            )
        fallback = self._fallback(job)
        obstacle = self._obstacle(job, fallback, len(attempt.prompt_ids)) if count else None
        detour = job.policy.when_failed(failure.reason, count, obstacle)
        assert fallback is not None  # when_failed raised otherwise
        ticket = job.ticket(len(attempt.prompt_ids), count)
        previous = attempt.handle if count else None
        try:
            return await self._attempt(job, summary, fallback, detour, ticket, attempt.prompt_ids, previous)
        except (Unavailable, ResourceExhausted) as error:
            raise Unavailable(
                f"{detour.reason}; its fallback {fallback.name!r} could not take the request: "
                f"{error.message}; {received(count)}"
            ) from error

    def _obstacle(self, job: _Job, fallback: Route | None, prompt_tokens: int) -> str | None:
        """Why `fallback` cannot continue this stream token for token; None when it can."""
        if fallback is None:
            return None  # the policy names the reason
        if not self._same_tokenizer(job.primary, fallback):
            return f"its fallback {fallback.name!r} has another tokenizer, so it cannot continue the tokens"
        if not self._fits(job, fallback, prompt_tokens):
            return f"the prompt and max_new_tokens do not fit its fallback {fallback.name!r}'s context"
        return None

    def _fits(self, job: _Job, route: Route, prompt_tokens: int) -> bool:
        """Whether ids tokenized for the primary mean the same to `route` and fit its context."""
        limit = route.max_model_len()
        return (
            self._same_tokenizer(job.primary, route)
            and limit is not None
            and prompt_tokens + job.valid.sampling.max_new_tokens <= limit
        )

    def _same_tokenizer(self, primary: Route, other: Route) -> bool:
        mine = self._fingerprint(primary.name)
        return bool(mine) and mine == self._fingerprint(other.name)

    async def _tokenize(self, job: _Job, route: Route, summary: Summary) -> list[int]:
        started = time.perf_counter()
        limit = self._router.context_limit(route.name)
        request = job.valid.request
        tokenized = await self._batcher.tokenize(
            tokenizer_pb2.TokenizeEntry(
                model=route.name,
                prompt=request.prompt,
                messages=request.messages,
                max_input_tokens=limit - job.valid.sampling.max_new_tokens,
                truncation=request.truncation,
            )
        )
        summary.timing.preprocess_ms += ms_since(started)
        return list(tokenized.token_ids)


def wire_id(valid: ValidRequest) -> str:
    """The id on the worker stream: unique there even when two callers choose the same request_id."""
    if not valid.caller_chose_id:
        return valid.request_id
    return f"{valid.request_id}#{next(_WIRE_SEQUENCE)}"
