"""One request's path through the gateway, top to bottom: validate, admit and tokenize, attempts (another
replica, then the fallback), respond.

`Pipeline.run` takes an Incoming (the request with its tenant, protocol, deadline and trace context,
from whichever front door) and is an async generator of Chunks: the text and ids of every step
(coalesced when several are queued), the last one carrying the final GenerateResponse with usage, the
timing breakdown, the model that served it and why that was a fallback. It raises one error type,
GatewayError, for the front door to translate; closing the generator early (the client cancelled or
went away) ends the current attempt, which cancels it on the worker so its KV blocks are freed.

Each attempt is one Slot on one route (attempt.py). The first route is decided at once, before
anything is awaited, so an overloaded route refuses at once; the prompt is tokenized while the slot
waits for a worker credit. gateway.fallback decides the detours: a primary that is unavailable or
(for `allow_fallback`) saturated sends the request to its fallback, and so does a primary queue that
lets the request go before a worker took it. Once sent, a lost worker's request goes to another ready
replica of the same route first (at most MAX_REPLICA_RETRIES times), token for token; then, or after
an engine error, the fallback policy decides: before the first token the fallback starts afresh,
mid-stream it continues from the tokens the client already holds (`prior_output_ids`, with the
detokenization state carried over so no text repeats). However the request ends, it is logged and
counted. This module must not know a front door's objects (gRPC contexts, HTTP requests) nor decide
admission (route.py does).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from gateway.adapter_names import ModelName
from gateway.admission import Refused
from gateway.attempt import Attempt
from gateway.errors import GatewayError, NotFound, ResourceExhausted, Unavailable
from gateway.fallback import received
from gateway.metrics import FALLBACKS, REQUEST_ERRORS, REQUESTS, observe_finished
from gateway.request import Request
from gateway.request_trace import TOKENIZE_RPC, RequestTrace
from gateway.samples import check_samples, run_samples
from gateway.tenants import TenantBook
from gateway.validation import validate
from strata.status import ELAPSED_KEY
from strata.v1 import tokenizer_pb2

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from gateway.fallback import Detour
    from gateway.request_values import Chunk, Failure, Incoming
    from gateway.route import Route
    from gateway.router import Router
    from gateway.settings import GatewaySettings
    from gateway.tokenize_batcher import TokenizeBatcher
    from gateway.tokenizer_client import TokenizerClient
    from strata.tracing import Tracing

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
        tokenizer: TokenizerClient,
        tracing: Tracing,
    ) -> None:
        """`tokenizer.models` is what the tokenizer service said of the routes' models (validation
        reads it)."""
        self._settings = settings
        self._router = router
        self._batcher = batcher
        self._tokenizer = tokenizer
        self._tracing = tracing
        self.tenants = TenantBook(settings.tenants)
        """Each tenant's quotas: a request holds a Reservation from validation to its end."""

    async def run(self, incoming: Incoming) -> AsyncGenerator[Chunk, None]:
        """The request's chunks; with n > 1, every sample's (samples.py), each run as one request."""
        n = check_samples(incoming.request)
        chunks = self._run_one(incoming) if n == 1 else run_samples(self._run_one, incoming, n)
        async with contextlib.aclosing(chunks) as closing:
            async for chunk in closing:
                yield chunk

    async def count_tokens(self, incoming: Incoming) -> int:
        """The prompt tokens `incoming` would take on its route (its conversation through the model's
        chat template, its tools as the model is asked for them), validated as a request is; nothing
        is admitted, generated nor taken from a quota."""
        valid = validate(incoming.request, self._settings, self._router.max_model_len, self._tokenizer.models)
        route = self._router.route(valid.model)
        tokenized = await self._batcher.tokenize(
            tokenizer_pb2.TokenizeEntry(
                model=route.name,
                prompt=valid.request.prompt,
                messages=valid.request.messages,
                tools=valid.request.tools,
                tool_choice=valid.request.tool_choice,
            )
        )
        return len(tokenized.token_ids)

    async def _run_one(self, incoming: Incoming) -> AsyncGenerator[Chunk, None]:
        """One sample's chunks; its spans, log line and metrics are recorded however it ends."""
        arrival = time.perf_counter()
        trace = RequestTrace(self._tracing, incoming, arrival, self._settings.telemetry.record_content)
        request_id = incoming.request.request_id
        model = incoming.request.model or self._settings.default_route
        if model not in self._router.models:
            model = UNKNOWN_MODEL  # a metric label: never a name a client made up
        done = False
        try:
            valid = validate(
                incoming.request, self._settings, self._router.max_model_len, self._tokenizer.models
            )
            request_id = valid.request_id
            trace.validated(valid)
            self.tenants.check_model(
                incoming.tenant, ModelName(valid.model, valid.adapter), self._settings.adapter_aliases
            )
            request = Request(incoming, valid, self._router.route(valid.model), trace, arrival)
            request.priority = self.tenants.priority_for(incoming.tenant, valid.request.priority)
            reservation = self.tenants.reserve(incoming.tenant, request.ticket().cost)
            try:
                # Closed with this generator, so the attempt ends (and is cancelled on the worker) when
                # a front door stops taking chunks, not whenever the abandoned generator is collected.
                async with contextlib.aclosing(self._serve(request)) as chunks:
                    async for chunk in chunks:
                        if chunk.final is not None:
                            observe_finished(chunk.final)
                            # The served model: `<route>:<adapter>` once a worker ran the adapter (a name
                            # a client made up never becomes a label).
                            REQUESTS.labels(chunk.final.model, incoming.protocol, "ok").inc()
                            done = True
                        yield chunk
            finally:
                reservation.release(request.input_tokens + len(request.token_ids))
        except GatewayError as error:
            done = True
            # The gateway's own time to the failure: a client can tell an at-once refusal from its own lag.
            error.metadata = (*error.metadata, (ELAPSED_KEY, f"{(error.created - arrival) * 1000:.3f}"))
            REQUEST_ERRORS.labels(model, error.code.name.lower()).inc()
            REQUESTS.labels(model, incoming.protocol, error.code.name.lower()).inc()
            trace.fail(incoming.request, request_id, error)
            raise
        finally:
            if not done:  # the client cancelled or went away
                REQUESTS.labels(model, incoming.protocol, "cancelled").inc()
                trace.fail(incoming.request, request_id, None)

    async def _serve(self, request: Request) -> AsyncGenerator[Chunk, None]:
        """One attempt after another until one answers in full, or nowhere is left to try."""
        route, detour = self._first_route(request)
        retries = 0
        failed: tuple[Attempt, Failure] | None = None
        """The last attempt a worker failed, and how; None before any did."""
        while True:
            try:
                attempt = Attempt.place(request, route, detour, retries)
            except (Unavailable, ResourceExhausted) as error:
                if failed is None:
                    raise
                route, detour, retries = self._gave_way(request, *failed, route, detour, error)
                continue
            lost: GatewayError | None = None
            with attempt:  # however it ends: its slot released, its spans closed
                if not request.prompt_ids or not self._fits(request, route, len(request.prompt_ids)):
                    request.prompt_ids = await self._tokenize(request, route)
                try:
                    link = await attempt.granted()
                except (Refused, Unavailable) as error:  # the queue let it go before a worker took it
                    lost = error
                else:
                    if detour is not None and not request.fallback_reason:
                        FALLBACKS.labels(model=request.primary.name, reason=detour.trigger.value).inc()
                    request.sent_to(route, detour)
                    attempt.send(link)
                    while True:
                        deltas = await request.sink.next_deltas()
                        attempt.record(deltas)
                        chunk, failure = request.add(deltas)
                        if chunk is not None:
                            yield chunk
                            if chunk.final is not None:
                                return
                        if failure is not None:
                            failed = (attempt, failure)
                            break
            if lost is None:
                assert failed is not None and failed[0] is attempt  # the worker failed this attempt
                route, detour, retries = self._recover(request, *failed)
            elif failed is None:
                route, detour, retries = self._requeue(request, route, lost)
            else:
                route, detour, retries = self._gave_way(request, *failed, route, detour, lost)

    def _first_route(self, request: Request) -> tuple[Route, Detour | None]:
        """The first route to queue on, decided at once: the primary unless it is down or saturated."""
        primary, fallback = request.primary, self._fallback(request)
        if fallback is None:
            return primary, None
        if not primary.available():
            reason = primary.unavailable_reason()
            return fallback, request.policy.when_unavailable(
                reason, fallback.available(), fallback.unavailable_reason()
            )
        saturation = primary.saturation(request.ticket())
        if saturation is not None:
            detour = request.policy.when_saturated(saturation, self._free(fallback, request))
            if detour is not None:
                return fallback, detour
        return primary, None

    def _requeue(self, request: Request, route: Route, lost: GatewayError) -> tuple[Route, Detour, int]:
        """Where a request the first route's queue let go goes next; raises `lost` when nowhere."""
        fallback = self._fallback(request)
        if route is not request.primary or fallback is None:
            raise lost
        if isinstance(lost, Refused):
            detour = request.policy.when_saturated(lost.message, self._free(fallback, request))
            if detour is None:
                raise lost
            return fallback, detour, 0
        return (
            fallback,
            request.policy.when_unavailable(
                lost.message, fallback.available(), fallback.unavailable_reason()
            ),
            0,
        )

    def _recover(
        self, request: Request, failed: Attempt, failure: Failure
    ) -> tuple[Route, Detour | None, int]:
        """Where the request goes after a worker failed `failed`, with the replica retries so far.

        A lost worker's request goes first to another replica of the same route, if one is ready:
        same model, same tokenizer, so a stream continues token for token (prior_output_ids). Only
        then, or after an engine error, does the fallback policy decide.
        """
        if failure.worker_lost and failed.replica_retries < MAX_REPLICA_RETRIES and failed.route.available():
            return failed.route, failed.detour, failed.replica_retries + 1
        return (*self._to_fallback(request, failed, failure), 0)

    def _gave_way(
        self,
        request: Request,
        failed: Attempt,
        failure: Failure,
        route: Route,
        detour: Detour | None,
        error: GatewayError,
    ) -> tuple[Route, Detour, int]:
        """A recovery could not be placed on `route`: a replica gives way to the fallback policy, and a
        fallback that cannot take the request ends it."""
        if route is failed.route:
            log.info(
                "request %s: no other replica of %r took it: %s", request.valid.request_id, route.name, error
            )
            return (*self._to_fallback(request, failed, failure), 0)
        assert detour is not None
        raise Unavailable(
            f"{detour.reason}; its fallback {route.name!r} could not take the request: "
            f"{error.message}; {received(len(request.token_ids))}"
        ) from error

    def _to_fallback(self, request: Request, failed: Attempt, failure: Failure) -> tuple[Route, Detour]:
        """The fallback for a request a worker failed; raises Unavailable when the policy says none."""
        count, reason = len(request.token_ids), failure.reason
        if failed.detour is not None:
            raise Unavailable(
                f"fallback model {failed.route.name!r} failed the request too: {reason} (it served model "
                f"{request.primary.name!r} because: {failed.detour.reason}); {received(count)}"
            )
        fallback = self._fallback(request)
        obstacle = self._obstacle(request, fallback, len(failed.prompt_ids)) if count else None
        detour = request.policy.when_failed(reason, count, obstacle)
        assert fallback is not None  # when_failed raised otherwise
        return fallback, detour

    def _fallback(self, request: Request) -> Route | None:
        """The fallback route when this request may use it at all."""
        return self._router.route(request.policy.fallback) if request.policy.usable else None

    @staticmethod
    def _free(route: Route, request: Request) -> bool:
        return route.available() and route.saturation(request.ticket()) is None

    def _obstacle(self, request: Request, fallback: Route | None, prompt_tokens: int) -> str | None:
        """Why `fallback` cannot continue this stream token for token; None when it can."""
        if fallback is None:
            return None  # the policy names the reason
        if not self._same_tokenizer(request.primary, fallback):
            return f"its fallback {fallback.name!r} has another tokenizer, so it cannot continue the tokens"
        if not self._fits(request, fallback, prompt_tokens):
            return f"the prompt and max_new_tokens do not fit its fallback {fallback.name!r}'s context"
        return None

    def _fits(self, request: Request, route: Route, prompt_tokens: int) -> bool:
        """Whether ids tokenized for the primary mean the same to `route` and fit its context."""
        limit = route.max_model_len()
        return (
            self._same_tokenizer(request.primary, route)
            and limit is not None
            and prompt_tokens + request.valid.sampling.max_new_tokens <= limit
        )

    def _same_tokenizer(self, primary: Route, other: Route) -> bool:
        models = self._tokenizer.models
        mine, theirs = models.get(primary.name), models.get(other.name)
        return mine is not None and theirs is not None and mine.fingerprint == theirs.fingerprint != ""

    def thinks(self, model: str) -> bool:
        """Whether `model`'s answers may open with reasoning in think tokens (gateway/reasoning.py)."""
        try:
            info = self._tokenizer.models.get(self._router.route(model).name)
        except NotFound:
            return False
        return info is not None and info.think_tokens

    async def _tokenize(self, request: Request, route: Route) -> list[int]:
        limit = self._router.context_limit(route.name)
        valid, trace = request.valid, request.trace
        hop = trace.open_hop(TOKENIZE_RPC, time.perf_counter())
        try:
            tokenized, call = await self._batcher.tokenize_timed(
                tokenizer_pb2.TokenizeEntry(
                    model=route.name,
                    prompt=valid.request.prompt,
                    messages=valid.request.messages,
                    tools=valid.request.tools,
                    tool_choice=valid.request.tool_choice,
                    max_input_tokens=limit - valid.sampling.max_new_tokens,
                    truncation=valid.request.truncation,
                    trace_context=trace.carrier(hop),
                )
            )
        except BaseException:
            trace.close_hop(hop, time.perf_counter())
            raise
        request.clock.wait("queue", call.started)
        trace.emit(request.clock)
        request.clock.hop(call, "preprocess", "tokenize")
        trace.emit(request.clock, {"tokenize": hop})
        trace.close_hop(hop, call.ended)
        return list(tokenized.token_ids)
