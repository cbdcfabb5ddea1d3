"""One Connect stream: what the gateway sends (submissions, cancellations) and what it is sent back.

A Connection rejects a submission whose deadline already passed or whose fields do not convert, and
hands the rest to its host (a StreamHost: the one check of parameters and ids, then a credit, then the
engine) under stream-unique engine ids (so two gateways may use the same request id). The requests it
accepted are held in open_requests.py, which ends them (finished, cancelled, expired or failed) and
describes each engine step's outputs as token updates; a submission whose output constraint is not
compiled yet waits in grammar_wait.py first. The Connection writes everything through its
OutboundQueue so the step loop never waits on a write. When the stream ends for any reason, every
request it still holds is aborted. This module must not choose status codes (errors.py does) nor
touch the gRPC context (server.py does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from services.worker.convert import (
    constraint_spec,
    ended_update,
    engine_priority,
    engine_prompt,
    itl_slo,
    remaining_s,
    sampling_params,
)
from services.worker.engine.sequence import FinishReason
from services.worker.errors import (
    REFUSALS,
    ProtocolError,
    TooManySubmissionsError,
    rejection_code,
    status_of,
)
from services.worker.grammar_wait import PendingCompiles
from services.worker.metrics import WORKER_REJECTIONS
from services.worker.open_requests import AcceptedRequest, OpenRequests, RequestHost
from services.worker.outbound import OutboundQueue
from strata.sampling import InvalidRequestError
from strata.v1 import worker_pb2

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterable, Iterable

    from services.worker.engine.async_engine import StepReport
    from services.worker.engine.grammar_compiler import GrammarCompiler
    from services.worker.engine.grammar_matcher import GrammarMatcher
    from services.worker.engine.sequence import StepOutput
    from strata.sampling import SamplingParams

log = logging.getLogger(__name__)


class StreamHost(RequestHost, Protocol):
    """What a Connection needs of the worker that runs its requests (host.py's WorkerHost), besides
    what its open requests need."""

    def info(self) -> worker_pb2.GetWorkerInfoResponse: ...

    @property
    def last_step(self) -> worker_pb2.StepInfo | None:
        """The engine's latest step (the warm-up's before any request), for a new stream's hello."""

    def credits_message(self) -> worker_pb2.Credits: ...

    def accept(
        self,
        engine_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int,
        owner: Connection,
        cache_salt: str = "",
        grammar: GrammarMatcher | None = None,
        itl_slo_s: float | None = None,
        adapter: str = "",
    ) -> None:
        """Check the request once, take a credit, queue it on the engine; raise what refuses it."""

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of this worker's model; raises InvalidRequestError when it has none."""

    def disconnect(self, connection: Connection) -> None: ...


class Connection:
    """The state of one Connect stream. Used from the event loop only."""

    def __init__(
        self, host: StreamHost, stream_id: int, client_name: str, *, model: str, max_submissions: int
    ) -> None:
        """`max_submissions` is the most submissions one ConnectRequest may carry; `model` labels metrics."""
        self.host = host
        self.client_name = client_name or "<unnamed>"
        self._model = model
        self._max_submissions = max_submissions
        self.outbound = OutboundQueue()
        self.failure: BaseException | None = None
        """Why the stream must end with an error status; None when it ends normally."""
        self._prefix = f"s{stream_id}/"
        self._open = OpenRequests(host, self._prefix, lambda update: self._push([update], ()))
        self._compiling = PendingCompiles(self._compiled)
        self._credits_sent: int | None = None
        self._ended = False

    @property
    def name(self) -> str:
        return self._prefix.rstrip("/")

    async def serve(
        self, first: worker_pb2.ConnectRequest, requests: AsyncIterable[worker_pb2.ConnectRequest]
    ) -> AsyncGenerator[worker_pb2.ConnectResponse, None]:
        """Answer the hello, apply the first message, read the rest on a task, yield merged output."""
        log.info("stream %s opened by %s", self.name, self.client_name)
        credits = self.host.credits_message()
        self._credits_sent = credits.requests
        # The last step (the warm-up's, at least) lets the gateway forecast before this stream runs any.
        hello = worker_pb2.WorkerHello(info=self.host.info())
        self.outbound.put(hello=hello, credits=credits, step=self.host.last_step)
        reader: asyncio.Task[None] | None = None
        if self._apply(first, first=True):
            reader = asyncio.create_task(self._read(requests))
        try:
            while (message := await self.outbound.get()) is not None:
                yield message
        finally:
            if reader is not None:
                reader.cancel()
            self.end()

    async def _read(self, requests: AsyncIterable[worker_pb2.ConnectRequest]) -> None:
        iterator = aiter(requests)
        try:
            while True:
                try:
                    message = await anext(iterator)
                except StopAsyncIteration:
                    return  # the gateway half-closed: it is done with this stream
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # any failure to read means the stream is gone
                    log.info("stream %s broke: %r", self.name, exc)
                    return
                if not self._apply(message, first=False):
                    return
        finally:
            self.end()

    def _apply(self, message: worker_pb2.ConnectRequest, *, first: bool) -> bool:
        """Apply one inbound message; False when it ends the stream (self.failure says why)."""
        try:
            self._receive(message, first=first)
        except (ProtocolError, TooManySubmissionsError) as exc:
            self.failure = exc
        except Exception as exc:  # a worker bug: end this stream with INTERNAL, keep the others
            log.exception("stream %s failed", self.name)
            self.failure = exc
        if self.failure is not None:
            self.end()
            return False
        return True

    def _receive(self, message: worker_pb2.ConnectRequest, *, first: bool) -> None:
        if not first and message.HasField("hello"):
            raise ProtocolError("hello is only allowed on the stream's first ConnectRequest")
        limit = self._max_submissions
        if len(message.submissions) > limit:
            raise TooManySubmissionsError(
                f"{len(message.submissions)} submissions in one ConnectRequest exceed the worker's limit "
                f"of {limit} (max_submissions_per_message): split the batch"
            )
        # Requests already open are cancelled first: the gateway counts their credits free at once and
        # may have merged a submission that needs one into this same message.
        early = {rid for rid in message.cancellations if rid in self._open}
        ended = [self._open.abort(rid) for rid in early]
        ended += [self._drop_compiling(rid) for rid in message.cancellations if rid in self._compiling]
        rejections: list[worker_pb2.Rejection] = []
        for submission in message.submissions:
            try:
                self._submit(submission)
            except REFUSALS as exc:
                rejections.append(self._rejection(submission.request_id, exc))
        # Then those submitted and cancelled in this one message.
        late = [rid for rid in dict.fromkeys(message.cancellations) if rid in self._open and rid not in early]
        ended += [self._open.abort(rid) for rid in late]
        ended += [self._drop_compiling(rid) for rid in message.cancellations if rid in self._compiling]
        self._push(ended, rejections)

    def _submit(self, submission: worker_pb2.Submission) -> None:
        request_id = submission.request_id
        if not request_id:
            raise InvalidRequestError("request_id", "", "must not be empty: ids name requests on the stream")
        if request_id in self._compiling:
            raise InvalidRequestError("request_id", request_id, "a request with this id is already running")
        remaining_s(submission)
        spec = constraint_spec(submission)
        grammar = None
        if spec is not None:
            compiler = self.host.grammar_compiler()
            grammar = compiler.lookup(spec)
            if grammar is None:
                sampling_params(submission)  # a bad parameter is refused now, not after the compile
                self._compiling.start(submission, spec, compiler)
                return
        self._accept(submission, grammar)

    def _compiled(self, submission: worker_pb2.Submission, outcome: GrammarMatcher | Exception) -> None:
        try:
            if isinstance(outcome, Exception):
                raise outcome
            self._accept(submission, outcome)
        except REFUSALS as exc:
            self._push((), [self._rejection(submission.request_id, exc)])
            return
        self._push((), ())  # the credit it took

    def _accept(self, submission: worker_pb2.Submission, grammar: GrammarMatcher | None) -> None:
        request_id = submission.request_id
        left_s = remaining_s(submission)
        engine_id = self._prefix + request_id
        prior = len(submission.prior_output_ids)
        # Everything that may raise comes before the credit is taken, so a refusal holds nothing.
        params, prompt, slo = sampling_params(submission), engine_prompt(submission), itl_slo(submission)
        if grammar is not None and not grammar.replay(submission.prior_output_ids):
            raise InvalidRequestError(
                "prior_output_ids",
                f"{prior} tokens",
                f"are not a prefix of the output that {grammar.spec.field} allows: {grammar.error}",
            )
        spans = self.host.spans.start(submission.trace_context)
        self.host.accept(
            engine_id,
            prompt,
            params,
            engine_priority(submission.priority),
            self,
            submission.cache_salt,
            grammar,
            slo,
            submission.adapter,
        )
        record = AcceptedRequest(
            request_id,
            engine_id,
            len(submission.prompt_ids),
            prior,
            time.monotonic(),
            output_tokens=prior,
            spans=spans,
        )
        self._open.add(record, left_s if submission.deadline_unix_ms else None)

    def _drop_compiling(self, request_id: str) -> worker_pb2.TokenUpdate:
        self._compiling.cancel(request_id)
        return ended_update(request_id, FinishReason.ABORTED, prompt_tokens=0, output_tokens=0)

    def collect(self, outputs: list[StepOutput], report: StepReport) -> list[worker_pb2.TokenUpdate]:
        """This stream's updates from one step; finished requests give their credits back here."""
        return self._open.collect(outputs, report)

    def send(self, updates: list[worker_pb2.TokenUpdate], step: worker_pb2.StepInfo) -> None:
        """Queue one step's updates with the credits and the step: gateways forecast from every step,
        theirs or not."""
        self._push(updates, (), step)

    def fail(self, engine_id: str, error: BaseException) -> None:
        """The engine could not add the request, or died with it in."""
        update = self._open.fail(engine_id, error)
        if update is not None:
            self._push([update], ())

    def abort_all(self) -> None:
        """End every open request and tell the gateway (a drain that ran out of time).

        The client did not cancel: the worker gave up on it, so it ends with ERROR, not CANCELLED.
        """
        self._push(self._open.abort_all(FinishReason.ERROR), ())

    def end(self) -> None:
        """The stream is over: abort what it still holds, flush what is queued, then stop writing."""
        if self._ended:
            return
        self._ended = True
        aborted = len(self._open) + len(self._compiling)
        self._compiling.cancel_all()
        self._open.discard_all("the Connect stream ended")
        self.outbound.close()
        self.host.disconnect(self)
        log.info("stream %s of %s ended, %d requests aborted", self.name, self.client_name, aborted)

    def _push(
        self,
        updates: Iterable[worker_pb2.TokenUpdate],
        rejections: Iterable[worker_pb2.Rejection],
        step: worker_pb2.StepInfo | None = None,
    ) -> None:
        updates, rejections = list(updates), list(rejections)
        credits = self.host.credits_message()
        if not updates and not rejections and step is None and credits.requests == self._credits_sent:
            return
        self._credits_sent = credits.requests
        self.outbound.put(updates=updates, rejections=rejections, credits=credits, step=step)

    def _rejection(self, request_id: str, error: BaseException) -> worker_pb2.Rejection:
        code, message = status_of(error)
        WORKER_REJECTIONS.labels(self._model, code.name.lower()).inc()
        return worker_pb2.Rejection(request_id=request_id, code=rejection_code(error), message=message)
