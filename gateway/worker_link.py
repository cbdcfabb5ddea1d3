"""One long-lived Connect stream to one worker, multiplexing every request the gateway sends it.

The link waits for the worker's health to say SERVING, introduces itself with the route's model and
the tokenizer service's fingerprint, then runs a writer task (merging the submissions and
cancellations queued in the same event-loop tick into one ConnectRequest) and a reader loop. For
each ConnectResponse the reader makes ONE batched Detokenize call covering every update in it, keeps
each request's detokenization state (window, read offset, held-back text), and pushes one Delta per
request onto that request's queue. A broken stream fails its open requests with UNAVAILABLE and
reconnects with backoff; a FAILED_PRECONDITION answer (another model or tokenizer) leaves the link
refused, with the reason kept for the error clients see. This module must not choose between links
(router.py does) nor shape client responses (pipeline.py does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import GatewayError, Unavailable, from_code
from gateway.request_state import Delta, OpenRequest
from gateway.tokenizer_client import INITIAL_BACKOFF_S, INTERNAL_MESSAGE_BYTES
from strata.rpc import MIB, SERVING, channel_options
from strata.v1 import tokenizer_pb2, worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Callable

    from gateway.settings import GatewaySettings
    from gateway.tokenizer_client import TokenizerClient

log = logging.getLogger(__name__)

WORKER_SERVICE = "strata.v1.WorkerService"
MAX_SUBMISSIONS_PER_MESSAGE = 1024
# Stop merging once a ConnectRequest is this big, well inside the worker's 16 MiB default bound.
MAX_MERGED_BYTES = 4 * MIB


class StreamClosedError(Exception):
    """The worker ended the Connect stream (its status is in the message)."""


class WorkerLink:
    """The gateway's stream to one worker address for one model."""

    def __init__(
        self,
        address: str,
        model: str,
        settings: GatewaySettings,
        tokenizer: TokenizerClient,
        on_change: Callable[[], None],
    ) -> None:
        self.address = address
        self.model = model
        self._settings = settings
        self._tokenizer = tokenizer
        self._on_change = on_change
        self._channel = grpc.aio.insecure_channel(address, options=channel_options(INTERNAL_MESSAGE_BYTES))
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._task: asyncio.Task[None] | None = None
        self._outbound: asyncio.Queue[worker_pb2.Submission | str] = asyncio.Queue()
        self._open: dict[str, OpenRequest] = {}
        self._reported_credits = 0
        self._sent_since_report = 0
        self.ready = False
        self.info: worker_pb2.GetWorkerInfoResponse | None = None
        """The worker's hello, kept after a disconnect (its limits rarely change)."""
        self.refusal = ""
        """Why the worker refused this gateway (FAILED_PRECONDITION); empty when it did not."""
        self.last_error = "not connected yet"

    @property
    def credits(self) -> int:
        """The worker's last reported credits minus the submissions sent since."""
        if not self.ready:
            return 0
        return max(0, self._reported_credits - self._sent_since_report)

    @property
    def not_ready_reason(self) -> str:
        return self.refusal or self.last_error

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"worker-link-{self.address}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._drop("the gateway is shutting down", expected=True)
        await self._channel.close()

    def submit(self, submission: worker_pb2.Submission, stop: tuple[str, ...]) -> OpenRequest:
        """Queue a submission for the next write; its deltas arrive on the returned request's queue."""
        if not self.ready:
            raise Unavailable(f"worker {self.address} is not ready: {self.not_ready_reason}")
        if submission.request_id in self._open:
            raise Unavailable(f"request id {submission.request_id!r} is already open on {self.address}")
        request = OpenRequest(submission.request_id, self.model, stop)
        self._open[request.wire_id] = request
        self._sent_since_report += 1
        self._outbound.put_nowait(submission)
        return request

    def cancel(self, request: OpenRequest) -> None:
        """Abort a request that is still open on this stream, freeing its KV blocks in the worker."""
        if self._open.get(request.wire_id) is request:
            del self._open[request.wire_id]
            self._outbound.put_nowait(request.wire_id)

    async def _run(self) -> None:
        backoff = INITIAL_BACKOFF_S
        while True:
            try:
                await self._wait_serving()
                fingerprint = await self._tokenizer.fingerprint(self.model)
                await self._session(fingerprint)
                reason = "the worker closed the stream"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.refusal = (
                        f"worker {self.address} refused this gateway for model {self.model!r} "
                        f"(the model or the tokenizer fingerprint differ): {exc.details()}"
                    )
                    log.error("%s; the route stays not ready until the worker accepts", self.refusal)
            except (GatewayError, StreamClosedError, asyncio.InvalidStateError) as exc:
                reason = str(exc)
            if self.ready:
                backoff = INITIAL_BACKOFF_S
            self._drop(reason)
            await asyncio.sleep(self._settings.reconnect_backoff_max_s if self.refusal else backoff)
            backoff = min(backoff * 2, self._settings.reconnect_backoff_max_s)

    async def _wait_serving(self) -> None:
        call = self._health.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE))
        try:
            async for response in call:
                if response.status == SERVING:
                    return
                self.last_error = f"worker {self.address} is not serving yet"
        finally:
            call.cancel()
        raise StreamClosedError(f"worker {self.address} ended its health watch")

    async def _session(self, fingerprint: str) -> None:
        call = self._stub.Connect()
        writer: asyncio.Task[None] | None = None
        try:
            hello = worker_pb2.ConnectHello(
                model=self.model, tokenizer_fingerprint=fingerprint, client_name=self._settings.name
            )
            await call.write(worker_pb2.ConnectRequest(hello=hello))
            first = await call.read()
            if first is grpc.aio.EOF or not first.HasField("hello"):
                raise StreamClosedError(f"worker {self.address} answered the hello without its own")
            self.info = first.hello.info
            self._outbound = asyncio.Queue()
            self._sent_since_report = 0
            self._reported_credits = first.credits.requests
            self.ready = True
            self.refusal = ""
            log.info(
                "connected to worker %s for model %s (%d credits)",
                self.address,
                self.model,
                self._reported_credits,
            )
            self._on_change()
            writer = asyncio.create_task(self._write(call, self._outbound), name=f"writer-{self.address}")
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    return
                await self._handle(response)
        finally:
            if writer is not None:
                writer.cancel()
            call.cancel()

    async def _write(
        self, call: grpc.aio.StreamStreamCall, outbound: asyncio.Queue[worker_pb2.Submission | str]
    ) -> None:
        try:
            while True:
                message = worker_pb2.ConnectRequest()
                item = await outbound.get()
                size = 0
                while True:
                    if isinstance(item, str):
                        message.cancellations.append(item)
                    else:
                        message.submissions.append(item)
                        size += item.ByteSize()
                    full = len(message.submissions) >= MAX_SUBMISSIONS_PER_MESSAGE or size >= MAX_MERGED_BYTES
                    if full or outbound.empty():
                        break
                    item = outbound.get_nowait()
                await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            # The reader sees the same broken stream and reconnects; make sure it wakes up.
            log.debug("write to worker %s failed: %s", self.address, exc)
            call.cancel()

    async def _handle(self, response: worker_pb2.ConnectResponse) -> None:
        if response.HasField("credits"):
            self._reported_credits = response.credits.requests
            self._sent_since_report = 0
        for rejection in response.rejections:
            rejected = self._open.pop(rejection.request_id, None)
            if rejected is not None:
                message = f"worker {self.address}: {rejection.message}"
                error = from_code(rejection.code, message, self._settings.overload_retry_after_s)
                rejected.deltas.put_nowait(Delta(error=error))
        targets: list[tuple[OpenRequest, worker_pb2.TokenUpdate]] = []
        entries: list[tokenizer_pb2.DetokenizeEntry] = []
        for update in response.updates:
            request = self._open.get(update.request_id)
            if request is None:  # cancelled, stopped or failed already
                continue
            if update.finished:
                del self._open[update.request_id]
            targets.append((request, update))
            entries.append(request.entry(update))
        if entries:
            await self._detokenize(targets, entries)

    async def _detokenize(
        self,
        targets: list[tuple[OpenRequest, worker_pb2.TokenUpdate]],
        entries: list[tokenizer_pb2.DetokenizeEntry],
    ) -> None:
        started = time.perf_counter()
        try:
            answer = await self._tokenizer.detokenize(tokenizer_pb2.DetokenizeRequest(entries=entries))
            if len(answer.results) != len(entries):
                raise Unavailable(
                    f"tokenizer service answered {len(answer.results)} results for {len(entries)} entries"
                )
        except GatewayError as exc:
            for request, _ in targets:
                self._fail(request, exc)
            return
        decode_ms = (time.perf_counter() - started) * 1000.0
        for (request, update), result in zip(targets, answer.results, strict=True):
            if result.HasField("error"):
                self._fail(request, from_code(result.error.code, result.error.message))
                continue
            delta = request.advance(update, result, decode_ms)
            if result.stopped:
                self.cancel(request)  # the worker may still be generating: free its KV blocks now
            request.deltas.put_nowait(delta)

    def _fail(self, request: OpenRequest, error: GatewayError) -> None:
        self.cancel(request)
        request.deltas.put_nowait(Delta(error=error))

    def _drop(self, reason: str, *, expected: bool = False) -> None:
        """Fail every open request and mark the link not ready; a loss nobody planned is a warning."""
        was_ready = self.ready
        self.ready = False
        self.last_error = f"worker {self.address}: {reason}"
        failed, self._open = self._open, {}
        error = Unavailable(f"worker {self.address} for model {self.model!r} is gone: {reason}")
        for request in failed.values():
            request.deltas.put_nowait(Delta(error=error))
        if was_ready:
            level = logging.INFO if expected else logging.WARNING
            log.log(level, "link to worker %s for model %s closed: %s", self.address, self.model, reason)
            self._on_change()
