"""The model-worker process: strata.v1.WorkerService over grpc.aio, its readiness and its shutdown.

`start` binds and announces the address first, then loads and warms the model in the background, so
health checks answer NOT_SERVING during the load and SERVING only once a real generation succeeded.
`stop` drains: health NOT_SERVING, new work refused, open requests finish (up to drain_timeout_s),
the rest are aborted, streams end, the server stops. `main` is the command line (`python -m
services.worker`); a model that fails to load ends the process with a non-zero status. This module
must not schedule requests nor build stream messages: host.py and connection.py do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING, TypeVar

from services.worker import adapter_admin
from services.worker.errors import REFUSALS, DrainingError, status_of
from services.worker.host import State, WorkerHost, rank_spec
from services.worker.model.ranks import run_follower
from services.worker.settings import WorkerSettings
from strata.rpc import RunningServer, shutdown_event, start_server
from strata.service_main import run_service
from strata.strict_handlers import add_servicer
from strata.tracing import Tracing
from strata.v1 import worker_pb2, worker_pb2_grpc

T = TypeVar("T")

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from pathlib import Path

    import grpc

log = logging.getLogger(__name__)

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]
SERVICE_NAME = SERVICE.full_name
# After a drain every stream has ended by itself; this only bounds a reader that never lets go.
STREAM_END_GRACE_S = 5.0


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """The gRPC face of a WorkerHost: statuses come from errors.status_of, nothing else."""

    def __init__(self, host: WorkerHost) -> None:
        self.host = host

    async def Connect(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[worker_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext[worker_pb2.ConnectRequest, worker_pb2.ConnectResponse],
    ) -> AsyncIterator[worker_pb2.ConnectResponse]:
        try:
            # The hello is read before the worker says whether it accepts (connect checks): a refusal
            # sent before it arrived could fail the caller's write of it instead of reaching its read.
            first = await anext(request_iterator, None)
            if first is None:
                return  # the gateway closed before saying hello
            connection = self.host.connect(first)
        except REFUSALS as exc:
            await context.abort(*status_of(exc))
            return
        # However the call ends (cancelled, disconnected, finished), its requests must not outlive it.
        context.add_done_callback(lambda _: connection.end())
        async with contextlib.aclosing(connection.serve(first, request_iterator)) as messages:
            async for message in messages:
                yield message
        if connection.failure is not None:
            await context.abort(*status_of(connection.failure))

    async def GetWorkerInfo(  # type: ignore[override]
        self, request: worker_pb2.GetWorkerInfoRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> worker_pb2.GetWorkerInfoResponse:
        return self.host.info()

    async def GetWorkerStats(  # type: ignore[override]
        self, request: worker_pb2.GetWorkerStatsRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> worker_pb2.GetWorkerStatsResponse:
        return self.host.stats()

    async def ListAdapters(  # type: ignore[override]
        self, request: worker_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> worker_pb2.ListAdaptersResponse:
        try:
            self.host.check_accepting()
            return await adapter_admin.list_adapters(self.host.engine)
        except REFUSALS as exc:
            await context.abort(*status_of(exc))
            raise  # abort raised already; this only tells the type checker

    async def LoadAdapter(  # type: ignore[override]
        self, request: worker_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> worker_pb2.LoadAdapterResponse:
        adapter = await self._admin(context, lambda: adapter_admin.load_adapter(self.host.engine, request))
        return worker_pb2.LoadAdapterResponse(adapter=adapter)

    async def UnloadAdapter(  # type: ignore[override]
        self, request: worker_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> worker_pb2.UnloadAdapterResponse:
        await self._admin(context, lambda: adapter_admin.unload_adapter(self.host.engine, request.name))
        return worker_pb2.UnloadAdapterResponse()

    async def _admin(
        self, context: grpc.aio.ServicerContext[object, object], work: Callable[[], Awaitable[T]]
    ) -> T:
        """An admin call: the caller's token checked, the worker serving, then `work`."""
        try:
            adapter_admin.authorize(self.host.settings.admin_token, context.invocation_metadata() or ())
            self.host.check_accepting()
            return await work()
        except REFUSALS as exc:
            await context.abort(*status_of(exc))
            raise  # abort raised already; this only tells the type checker


class WorkerServer:
    """A listening worker: its address, readiness, and graceful stop."""

    def __init__(self, host: WorkerHost, running: RunningServer) -> None:
        self.host = host
        self.running = running
        self._stopped = False
        self._load = asyncio.create_task(self._load_and_serve(), name="worker-load")
        self._watch = asyncio.create_task(self._not_serving_on_failure(), name="worker-watch")

    @property
    def address(self) -> str:
        return self.running.address

    async def _load_and_serve(self) -> None:
        settings = self.host.settings
        log.info("loading model %s from %s on %s", settings.model_name, settings.model_path, self.host.device)
        try:
            await self.host.load()
        except asyncio.CancelledError:
            raise
        except Exception:  # the error stays in host.error; wait_ready and main report it
            log.exception(
                "model %s from %s failed to load or warm up", settings.model_name, settings.model_path
            )
            return
        if self.host.state is State.READY:
            await self.running.set_serving(True)
            log.info(
                "worker ready: model %s on %s, listening on %s",
                settings.model_name,
                self.host.device,
                self.address,
            )

    async def _not_serving_on_failure(self) -> None:
        await self.host.failed.wait()
        await self.running.set_serving(False)

    async def wait_ready(self) -> None:
        """Return once health is SERVING; raise the load (or warm-up) error if it failed instead."""
        await asyncio.wait({self._load})  # never raises: the outcome is read from the host
        if self.host.error is not None:
            raise self.host.error
        if not self.host.ready.is_set():
            raise DrainingError("the worker was stopped before its model was ready")

    async def wait_failed(self) -> BaseException:
        """The error that made this worker unable to serve (load failure or engine death)."""
        await self.host.failed.wait()
        assert self.host.error is not None
        return self.host.error

    async def stop(self, grace: float | None = None) -> None:
        """Drain (up to `grace`, default drain_timeout_s), abort what is left, end streams, stop."""
        if self._stopped:
            return
        self._stopped = True
        # First, so a load finishing now cannot turn health SERVING after the drain began.
        for task in (self._load, self._watch):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.running.set_serving(False)
        await self.host.drain(self.host.settings.drain_timeout_s if grace is None else grace)
        await self.running.stop(STREAM_END_GRACE_S)
        await self.host.close()
        log.info("worker stopped")


async def start(
    settings: WorkerSettings, announce_file: Path | None = None, tracing: Tracing | None = None
) -> WorkerServer:
    """Listen (and announce) now; load and warm up in the background (see WorkerServer.wait_ready)."""
    host = WorkerHost(settings, tracing or Tracing.off())
    servicer = WorkerServicer(host)
    running = await start_server(
        settings.listen,
        register=[lambda server: add_servicer(server, servicer, SERVICE)],
        service_names=[SERVICE_NAME],
        max_message_bytes=settings.max_message_bytes,
        limits=settings.rpc_limits,
        announce_file=announce_file,
        health_listen=settings.health_listen,
        tls=settings.tls,
    )
    log.info("worker listening on %s (NOT_SERVING until the model is loaded)", running.address)
    return WorkerServer(host, running)


async def serve(settings: WorkerSettings, announce_file: Path | None, tracing: Tracing) -> int:
    """Run until SIGTERM/SIGINT (0, after a drain) or until the model fails to load or the engine dies (1).
    Started by a launcher as a rank above 0 (torchrun's RANK), follow rank 0 instead of serving."""
    if settings.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) > 0:
        # On this (the main) thread, which may set signal handlers; nothing else runs on the loop.
        return run_follower(rank_spec(settings))
    stop = shutdown_event()
    server = await start(settings, announce_file, tracing)
    stopping = asyncio.create_task(stop.wait())
    failing = asyncio.create_task(server.wait_failed())
    await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if failing.done():
        log.error("worker cannot serve, exiting: %r", failing.result())
        await server.stop(grace=0)
        return 1
    failing.cancel()
    log.info("shutdown requested: draining")
    await server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m services.worker [--config PATH] [--index N] [--announce-file PATH]`."""
    return run_service(
        WorkerSettings,
        serve,
        argv,
        prog="python -m services.worker",
        description=__doc__,
        service_name="strata-worker",
        indexed=True,
    )
