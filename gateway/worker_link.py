"""One long-lived Connect stream to one worker, multiplexing every request the gateway sends it.

The link waits for the worker's health to say SERVING, introduces itself with the route's model and the
tokenizer service's fingerprint, then runs a writer task (link_writer.py) and a reader loop. For each
ConnectResponse the reader makes ONE batched Detokenize call covering every update in it, hands each
request its result (request.py keeps the state that call needs), and feeds the message to the LinkLoad
that the route's forecast reads (forecast.py). Each submission rides on a Slot granted on this link
(credits.py counts them, so the worker is never sent more than it accepts); the route cancels the
submission of a released slot if the worker still runs it, and every change of the credits the stream
brings calls the route's dispatcher (`on_capacity`) at once. A broken stream fails its open
requests with UNAVAILABLE and reconnects with backoff; a FAILED_PRECONDITION answer (another model or
tokenizer) leaves the link refused, with the reason kept for the error clients see. This module must
not choose between links (route.py does) nor shape client responses (request.py does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.credits import StreamCredits
from gateway.errors import GatewayError, TokenizerUnavailable, Unavailable, from_code
from gateway.forecast import LinkLoad
from gateway.link_writer import write_merged
from gateway.metrics import WORKER_SUBMISSIONS
from gateway.tokenizer_client import INITIAL_BACKOFF_S, INTERNAL_MESSAGE_BYTES
from strata.rpc import SERVING, aio_channel, channel_options
from strata.v1 import tokenizer_pb2, worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Callable

    from gateway.credits import Slot
    from gateway.delta_sink import DeltaSink
    from gateway.settings import GatewaySettings
    from gateway.tokenizer_client import TokenizerClient

log = logging.getLogger(__name__)

WORKER_SERVICE = "strata.v1.WorkerService"


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
        on_capacity: Callable[[], None] | None = None,
    ) -> None:
        """`on_capacity` is called at every change of the credits or readiness that the stream brings
        (the worker's reports, a connection, a drop, leaving): the route's dispatcher, run at once."""
        self.address = address
        self.model = model
        self._settings = settings
        self._tokenizer = tokenizer
        self._on_change = on_change
        self._on_capacity = on_capacity or (lambda: None)
        self._channel = aio_channel(address, channel_options(INTERNAL_MESSAGE_BYTES), settings.internal_tls)
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._task: asyncio.Task[None] | None = None
        self._outbound: asyncio.Queue[worker_pb2.Submission | str] = asyncio.Queue()
        self._open: dict[str, DeltaSink] = {}
        """Where the updates of the requests the worker runs for this stream go, by wire id."""
        self._idle = asyncio.Event()
        self._delivering = False
        """A message's deltas are being detokenized: a finished request's last one is not out yet."""
        self.credits = StreamCredits()
        self.load = LinkLoad()
        self.ready = False
        self.leaving = False
        """Set when the worker's address vanished from discovery: no new requests, close when idle."""
        self.submitted = 0
        """Requests submitted over this link's life."""
        self.info: worker_pb2.GetWorkerInfoResponse | None = None
        """The worker's hello, kept after a disconnect (its limits rarely change)."""
        self.refusal = ""
        """Why the worker refused this gateway (FAILED_PRECONDITION); empty when it did not."""
        self.last_error = "not connected yet"

    async def list_adapters(self, timeout_s: float) -> worker_pb2.ListAdaptersResponse:
        """The LoRA adapters the worker serves (gateway/adapter_admin.py lists and forwards them)."""
        response: worker_pb2.ListAdaptersResponse = await self._stub.ListAdapters(
            worker_pb2.ListAdaptersRequest(), timeout=timeout_s
        )
        return response

    async def load_adapter(
        self, request: worker_pb2.LoadAdapterRequest, token: str, timeout_s: float
    ) -> None:
        metadata = (("authorization", f"Bearer {token}"),)
        await self._stub.LoadAdapter(request, timeout=timeout_s, metadata=metadata)

    async def unload_adapter(self, name: str, token: str, timeout_s: float) -> None:
        metadata = (("authorization", f"Bearer {token}"),)
        await self._stub.UnloadAdapter(
            worker_pb2.UnloadAdapterRequest(name=name), timeout=timeout_s, metadata=metadata
        )

    @property
    def free_credits(self) -> int:
        """Slots the route may still grant on this link: 0 when the link is not usable."""
        if not self.ready or self.leaving:
            return 0
        return self.credits.available()

    @property
    def open_requests(self) -> int:
        return len(self._open)

    @property
    def open_load(self) -> int:
        """Requests open on the worker from every gateway, as prefix routing counts load: this
        stream's granted slots (sent or about to be) plus other gateways' at the last report."""
        return self.credits.held + self.credits.others

    def set_leaving(self, leaving: bool = True) -> None:
        """Take no new requests (the address left discovery), or take them again; open ones run on."""
        self.leaving = leaving
        self._on_capacity()

    async def wait_idle(self) -> None:
        """Return once no request is open on this link and every delta is delivered."""
        while self._open or self._delivering:
            self._idle.clear()
            await self._idle.wait()

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

    def submit(self, slot: Slot[WorkerLink], submission: worker_pb2.Submission, sink: DeltaSink) -> None:
        """Queue a submission (named by its wire id) for the next write, on the credit `slot` holds
        here; `sink` gets what the worker sends back for it. Unavailable when the stream is down."""
        assert slot.link is self, "a submission rides on a slot granted on this link"
        if not self.ready:
            raise Unavailable(f"worker {self.address} is not ready: {self.not_ready_reason}")
        wire_id = slot.wire_id = submission.request_id
        self.credits.sent(slot)
        self._open[wire_id] = sink
        self.load.sent(submission, slot.first_token_due, slot.ticket.tenant, slot.ticket.prefix)
        self.submitted += 1
        WORKER_SUBMISSIONS.labels(self.model, self.address).inc()
        self._outbound.put_nowait(submission)

    def cancel(self, wire_id: str) -> None:
        """Abort a request still open on this stream (none: nothing), freeing its KV blocks in the
        worker. The worker reads a cancellation before any submission queued after it, so the credit
        its slot gave back is free already."""
        if wire_id and self._open.pop(wire_id, None) is not None:
            self.load.forget(wire_id)
            self._outbound.put_nowait(wire_id)
            self._note_idle()

    def _note_idle(self) -> None:
        if not self._open and not self._delivering:
            self._idle.set()

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
            self.credits.reset(first.hello.info.max_requests, first.credits.requests)
            self.load.clear()
            self.load.observe(first, time.monotonic())  # the latest step: a forecast before any of ours
            self.ready = True
            self.refusal = ""
            log.info(
                "connected to worker %s for model %s (%d credits)",
                self.address,
                self.model,
                first.credits.requests,
            )
            self._on_change()
            self._on_capacity()
            writer = asyncio.create_task(
                write_merged(call, self._outbound, self.model, self.address), name=f"writer-{self.address}"
            )
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    return
                await self._handle(response, time.perf_counter())
        finally:
            if writer is not None:
                writer.cancel()
            call.cancel()

    async def _handle(self, response: worker_pb2.ConnectResponse, received: float) -> None:
        self.load.observe(response, time.monotonic())
        for rejection in response.rejections:
            rejected = self._open.pop(rejection.request_id, None)
            if rejected is not None:
                message = f"worker {self.address}: {rejection.message}"
                rejected.fail(from_code(rejection.code, message, self._settings.overload_retry_after_s))
        targets: list[tuple[str, DeltaSink, worker_pb2.TokenUpdate]] = []
        entries: list[tokenizer_pb2.DetokenizeEntry] = []
        for update in response.updates:
            sink = self._open.get(update.request_id)
            if sink is None:  # cancelled, stopped or failed already
                continue
            if update.finished:
                del self._open[update.request_id]
            targets.append((update.request_id, sink, update))
            entries.append(sink.entry(update, self.model))
        if response.HasField("credits"):
            self.credits.report(response.credits.requests, len(self._open))
        self._on_capacity()
        if entries:
            self._delivering = True
            try:
                await self._detokenize(targets, entries, received)
            finally:
                self._delivering = False
        self._note_idle()

    async def _detokenize(
        self,
        targets: list[tuple[str, DeltaSink, worker_pb2.TokenUpdate]],
        entries: list[tokenizer_pb2.DetokenizeEntry],
        received: float,
    ) -> None:
        try:
            results, call = await self._tokenizer.detokenize(entries)
        except TokenizerUnavailable as lost:
            for wire_id, sink, _ in targets:
                self.cancel(wire_id)
                sink.fail(lost)
            return
        for (wire_id, sink, update), result in zip(targets, results, strict=True):
            if result.HasField("error"):
                self.cancel(wire_id)
                sink.fail(from_code(result.error.code, result.error.message))
                continue
            if result.stopped:
                self.cancel(wire_id)  # the worker may still be generating: free its KV blocks now
            sink.deliver(update, result, received, call)

    def _drop(self, reason: str, *, expected: bool = False) -> None:
        """Fail every open request and mark the link not ready; a loss nobody planned is a warning."""
        was_ready = self.ready
        self.ready = False
        self.last_error = f"worker {self.address}: {reason}"
        failed, self._open = self._open, {}
        self.credits.reset(0, 0)
        self.load.clear()
        error = Unavailable(f"worker {self.address} for model {self.model!r} is gone: {reason}")
        for sink in failed.values():
            sink.fail(error)
        self._note_idle()
        self._on_capacity()
        if was_ready:
            level = logging.INFO if expected else logging.WARNING
            log.log(level, "link to worker %s for model %s closed: %s", self.address, self.model, reason)
            self._on_change()
