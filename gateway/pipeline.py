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
turn into a status. As the request moves, the pipeline moves its StageClock (the timing parts) and its
RequestTrace turns each part into spans; however it ends, it is logged and counted. This module must
not know gRPC servicer contexts (the servicer passes the deadline and trace context in) nor decide
admission (router.py does).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from gateway.admission import (
    Refused,
    Ticket,
    deadline_from_unix_ms,
    estimate_prompt_tokens,
    priority_of,
)
from gateway.errors import GatewayError, ResourceExhausted, Unavailable
from gateway.fallback import Detour, FallbackPolicy, received
from gateway.job import TRACE_KEYS, Attempt, CallInfo, Job, wire_id
from gateway.metrics import FALLBACKS, REQUEST_ERRORS, observe_finished
from gateway.request_state import Delta, OpenRequest
from gateway.request_trace import CONNECT_RPC, TOKENIZE_RPC, RequestTrace
from gateway.summary import Chunk, Failure, Summary
from gateway.validation import validate
from strata.v1 import common_pb2, tokenizer_pb2, worker_pb2

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Callable

    from gateway.route import Route
    from gateway.router import Router
    from gateway.settings import GatewaySettings
    from gateway.tokenize_batcher import TokenizeBatcher
    from gateway.validation import ValidRequest
    from gateway.worker_link import WorkerLink
    from strata.tracing import Tracing
    from strata.v1 import gateway_pb2

__all__ = ["TRACE_KEYS", "CallInfo", "Chunk", "Pipeline"]

log = logging.getLogger(__name__)

UNKNOWN_MODEL = "unknown"
# A lost worker's request tries at most this many other replicas of its route before the fallback.
MAX_REPLICA_RETRIES = 2


class Pipeline:
    """Runs requests through the tokenizer and a worker link of the route (or of its fallback)."""

    def __init__(
        self,
        settings: GatewaySettings,
        router: Router,
        batcher: TokenizeBatcher,
        fingerprint: Callable[[str], str],
        tracing: Tracing,
    ) -> None:
        """`fingerprint(model)` is the tokenizer fingerprint of a route's model ("" when unknown)."""
        self._settings = settings
        self._router = router
        self._batcher = batcher
        self._fingerprint = fingerprint
        self._tracing = tracing

    async def run(self, request: gateway_pb2.GenerateRequest, call: CallInfo) -> AsyncGenerator[Chunk, None]:
        """The request's chunks; its spans, log line and metrics are recorded however it ends."""
        arrival = time.perf_counter()
        trace = RequestTrace(
            self._tracing, request, arrival, call.trace_context, self._settings.telemetry.record_content
        )
        request_id = request.request_id
        model = request.model or self._settings.default_route
        if model not in self._router.models:
            model = UNKNOWN_MODEL  # a metric label: never a name a client made up
        done = False
        try:
            valid = validate(request, self._settings, self._router.max_model_len)
            request_id = valid.request_id
            trace.validated(valid)
            async for chunk in self._run(valid, call, trace, arrival):
                if chunk.final is not None:
                    chunk.final.trace_id = trace.trace_id
                    observe_finished(chunk.final)
                    done = True
                yield chunk
        except GatewayError as error:
            done = True
            REQUEST_ERRORS.labels(model, error.code.name.lower()).inc()
            trace.fail(request, request_id, error)
            raise
        finally:
            if not done:  # the client cancelled or went away
                trace.fail(request, request_id, None)

    async def _run(
        self, valid: ValidRequest, call: CallInfo, trace: RequestTrace, arrival: float
    ) -> AsyncGenerator[Chunk, None]:
        request = valid.request
        primary = self._router.route(valid.model)
        job = Job(
            valid=valid,
            call=call,
            primary=primary,
            policy=FallbackPolicy.of(primary, request),
            priority=priority_of(request.priority),
            deadline=deadline_from_unix_ms(call.deadline_unix_ms),
            trace=trace,
        )
        summary = Summary(valid, arrival)
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
                if failure is not None or (chunk is not None and chunk.final is not None):
                    self._close_attempt(job, attempt, summary)
                if chunk is not None:
                    if chunk.final is not None:
                        trace.finish(chunk.final, summary.device_memory_bytes)
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
            if summary.ended_attempt is None or summary.ended_attempt.submitted != attempt.handle.submitted:
                job.trace.close_hop(attempt.hop, time.perf_counter())

    @staticmethod
    def _close_attempt(job: Job, attempt: Attempt, summary: Summary) -> None:
        """Spans for the part of the request the attempt that just ended took."""
        ended = summary.ended_attempt
        assert ended is not None
        job.trace.emit(summary.clock, {"worker": attempt.hop})
        job.trace.close_hop(attempt.hop, ended.received if ended.received is not None else ended.ended)

    def _choose(self, job: Job, ticket: Ticket) -> tuple[Route, Detour | None]:
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

    def _fallback(self, job: Job) -> Route | None:
        """The fallback route when this request may use it at all."""
        return self._router.route(job.policy.fallback) if job.policy.usable else None

    @staticmethod
    def _free(route: Route, ticket: Ticket) -> bool:
        return route.available() and route.saturation(ticket) is None

    async def _attempt(
        self,
        job: Job,
        summary: Summary,
        route: Route,
        detour: Detour | None,
        ticket: Ticket,
        prompt: list[int] | None = None,
        previous: OpenRequest | None = None,
    ) -> Attempt:
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
            try:
                link = await admission.granted(ticket.prompt_tokens if previous else len(prompt))
            except (Refused, Unavailable) as error:
                lost: GatewayError = error
            else:
                link = admission.hand_over()
                return self._submit(job, route, link, prompt, detour, summary, previous)
        route, detour = self._requeue(job, route, lost, ticket)
        return await self._attempt(job, summary, route, detour, ticket, prompt, previous)

    def _requeue(self, job: Job, route: Route, lost: GatewayError, ticket: Ticket) -> tuple[Route, Detour]:
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
        job: Job,
        route: Route,
        link: WorkerLink,
        prompt: list[int],
        detour: Detour | None,
        summary: Summary,
        previous: OpenRequest | None,
    ) -> Attempt:
        prior = list(summary.token_ids) if previous is not None else []
        hop = job.trace.open_hop(CONNECT_RPC, time.perf_counter(), **{"server.address": link.address})
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(job.valid.sampling)
        sampling.ClearField("stop")  # stop strings are matched here, not by the worker
        submission = worker_pb2.Submission(
            request_id=wire_id(job.valid),
            prompt_ids=prompt,
            sampling=sampling,
            deadline_unix_ms=job.call.deadline_unix_ms,
            trace_context=job.trace.carrier(hop) or job.call.trace_context,
            priority=job.priority.worker_priority,
            prior_output_ids=prior,
        )
        try:
            handle = link.submit(submission, job.valid.stop)
        except Unavailable as error:  # the link broke between the grant and now: fail this attempt
            handle = OpenRequest(submission.request_id, route.name, job.valid.stop)
            handle.deltas.put_nowait(Delta(error=error))
            self._sent(job, summary, route, handle, prompt, detour)
            return Attempt(route, None, handle, prompt, detour, hop)
        first_detour = detour is not None and not summary.fallback_reason  # a replica retry is not another
        self._sent(job, summary, route, handle, prompt, detour)
        if previous is not None:
            handle.resume(previous)  # before any update of the new stream is read: same event-loop tick
            summary.failover_at_token = len(prior)
        if detour is not None and first_detour:
            FALLBACKS.labels(model=job.primary.name, reason=detour.trigger.value).inc()
        return Attempt(route, link, handle, prompt, detour, hop)

    @staticmethod
    def _sent(
        job: Job,
        summary: Summary,
        route: Route,
        handle: OpenRequest,
        prompt: list[int],
        detour: Detour | None,
    ) -> None:
        """The request left for a worker: its wait so far was queueing; a new attempt starts."""
        summary.clock.wait("queue", handle.submitted)
        job.trace.emit(summary.clock)
        summary.serve(route.name, len(prompt), handle.submitted, detour.reason if detour else "")

    async def _recover(self, job: Job, attempt: Attempt, failure: Failure, summary: Summary) -> Attempt:
        """The next attempt after a worker failed this one, or the Unavailable that ends the request.

        A lost worker's request goes first to another replica of the same route, if one is ready:
        same model, same tokenizer, so a stream continues token for token (prior_output_ids). Only
        then, or after an engine error, does the fallback policy decide.
        """
        count = len(summary.token_ids)
        if failure.worker_lost and attempt.replica_retries < MAX_REPLICA_RETRIES:
            retry = await self._other_replica(job, attempt, summary)
            if retry is not None:
                return retry
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

    async def _other_replica(self, job: Job, attempt: Attempt, summary: Summary) -> Attempt | None:
        """The request on another ready replica of the attempt's route; None when none can take it now."""
        if not attempt.route.available():
            return None
        count = len(summary.token_ids)
        ticket = job.ticket(len(attempt.prompt_ids), count)
        previous = attempt.handle if count else None
        try:
            retry = await self._attempt(
                job, summary, attempt.route, attempt.detour, ticket, attempt.prompt_ids, previous
            )
        except (Unavailable, ResourceExhausted) as error:
            log.info(
                "request %s: no other replica of %r took it: %s",
                job.valid.request_id,
                attempt.route.name,
                error,
            )
            return None
        return replace(retry, replica_retries=attempt.replica_retries + 1)

    def _obstacle(self, job: Job, fallback: Route | None, prompt_tokens: int) -> str | None:
        """Why `fallback` cannot continue this stream token for token; None when it can."""
        if fallback is None:
            return None  # the policy names the reason
        if not self._same_tokenizer(job.primary, fallback):
            return f"its fallback {fallback.name!r} has another tokenizer, so it cannot continue the tokens"
        if not self._fits(job, fallback, prompt_tokens):
            return f"the prompt and max_new_tokens do not fit its fallback {fallback.name!r}'s context"
        return None

    def _fits(self, job: Job, route: Route, prompt_tokens: int) -> bool:
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

    async def _tokenize(self, job: Job, route: Route, summary: Summary) -> list[int]:
        limit = self._router.context_limit(route.name)
        request = job.valid.request
        hop = job.trace.open_hop(TOKENIZE_RPC, time.perf_counter())
        try:
            tokenized, call = await self._batcher.tokenize_timed(
                tokenizer_pb2.TokenizeEntry(
                    model=route.name,
                    prompt=request.prompt,
                    messages=request.messages,
                    max_input_tokens=limit - job.valid.sampling.max_new_tokens,
                    truncation=request.truncation,
                    trace_context=job.trace.carrier(hop),
                )
            )
        except BaseException:
            job.trace.close_hop(hop, time.perf_counter())
            raise
        summary.clock.wait("queue", call.started)
        job.trace.emit(summary.clock)
        summary.clock.hop(call, "preprocess", "tokenize")
        job.trace.emit(summary.clock, {"tokenize": hop})
        job.trace.close_hop(hop, call.ended)
        return list(tokenized.token_ids)
