"""The gateway's gRPC server: the strata.v1.Gateway servicer, readiness, start and stop, and `main`.

`start` binds the listen address (health NOT_SERVING) and, with `http_listen`, the HTTP API
(http_server.py, over the same pipeline), opens the tokenizer connection and the routes' worker
links, and returns at once; health turns SERVING when the tokenizer is serving and every route has a
ready link (or a fallback with one, which then serves it), and follows them as they come and go.
`main` runs until SIGTERM or SIGINT, then drains: NOT_SERVING, no new calls on either front door,
running requests finish within the grace period, links close. This module must not hold request
logic (pipeline.py) nor map errors to codes (errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from gateway.adapter_admin import served_adapters
from gateway.auth import ApiKeyInterceptor, tenant_of
from gateway.errors import GatewayError, abort
from gateway.http_server import HttpFrontDoor
from gateway.metrics import ROUTER_GAUGES, STUCK_STREAMS
from gateway.pipeline import Pipeline
from gateway.request_trace import TRACE_KEYS
from gateway.request_values import Incoming
from gateway.router import Router
from gateway.settings import GatewaySettings
from gateway.tenant_settings import DEFAULT_TENANT
from gateway.tokenize_batcher import TokenizeBatcher
from gateway.tokenizer_client import TokenizerClient
from strata.rpc import RunningServer, announce, shutdown_event, start_server
from strata.service_main import run_service
from strata.strict_handlers import add_servicer
from strata.tracing import Tracing
from strata.v1 import gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from pathlib import Path

    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

log = logging.getLogger(__name__)

SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]
SERVICE_NAME = SERVICE.full_name


def incoming(
    request: gateway_pb2.GenerateRequest, context: Context, keys: tuple[tuple[bytes, str], ...] = ()
) -> Incoming:
    """The pipeline's view of a gRPC call: the request, its tenant (by its API key among `keys`), its
    deadline and its W3C trace context."""
    remaining = context.time_remaining()
    deadline = 0 if remaining is None else int((time.time() + remaining) * 1000)
    metadata = context.invocation_metadata() or ()
    trace = {key: value for key, value in metadata if key in TRACE_KEYS}
    tenant = tenant_of(dict(metadata).get("authorization"), keys, DEFAULT_TENANT) if keys else DEFAULT_TENANT
    return Incoming(request, protocol="grpc", tenant=tenant, deadline_unix_ms=deadline, trace_context=trace)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """strata.v1.Gateway over a pipeline and its router."""

    def __init__(
        self,
        pipeline: Pipeline,
        router: Router,
        tokenizer: TokenizerClient,
        default_model: str,
        idle_timeout_s: float,
        keys: tuple[tuple[bytes, str], ...] = (),
    ) -> None:
        """`keys`: every accepted API key with its tenant (none: every call is the default tenant's)."""
        self._pipeline = pipeline
        self._router = router
        self._tokenizer = tokenizer
        self._default_model = default_model
        self._idle_timeout_s = idle_timeout_s
        self._keys = keys

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: Context
    ) -> gateway_pb2.GenerateResponse:
        try:
            async with contextlib.aclosing(
                self._pipeline.run(incoming(request, context, self._keys))
            ) as chunks:
                async for chunk in chunks:
                    if chunk.final is not None:
                        return chunk.final
        except GatewayError as error:
            await abort(context, error)
        raise AssertionError("the pipeline ended without a final chunk")

    async def GenerateStream(  # type: ignore[override]  # writes through context.write, returns None
        self, request: gateway_pb2.GenerateRequest, context: Context
    ) -> None:
        """Streams the chunks; a client that takes none of them for stream_idle_timeout_s loses the
        request (cancelled on the worker), so a stuck reader holds no KV blocks and no buffers.

        The pipeline is closed (ending the request's attempt, which cancels it on the worker) before
        the call is aborted: the abort's status waits behind the write the client never took, so
        aborting first would hold the request until the client reads again or goes away.
        """
        stuck = False
        try:
            async with contextlib.aclosing(
                self._pipeline.run(incoming(request, context, self._keys))
            ) as chunks:
                async for chunk in chunks:
                    message = gateway_pb2.GenerateStreamResponse(
                        text=chunk.text,
                        token_ids=chunk.token_ids,
                        final=chunk.final if chunk.final is not None else chunk.sample_final,
                        logprobs=chunk.logprobs,
                        index=chunk.index,
                    )
                    try:
                        await asyncio.wait_for(context.write(message), self._idle_timeout_s)
                    except TimeoutError:
                        STUCK_STREAMS.labels(request.model or self._default_model).inc()
                        stuck = True
                        break
        except GatewayError as error:
            await abort(context, error)
        if stuck:
            await context.abort(
                grpc.StatusCode.CANCELLED,
                f"the client read nothing for {self._idle_timeout_s:g} s "
                "(stream_idle_timeout_s): the request was cancelled",
            )

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: Context
    ) -> gateway_pb2.ListModelsResponse:
        models = []
        for route in self._router.routes():
            status = route.status()
            tokenizer = self._tokenizer.models.get(route.name)
            models.append(
                gateway_pb2.ModelInfo(
                    name=route.name,
                    max_model_len=status.max_model_len,
                    ready_workers=status.ready_workers,
                    configured_workers=status.configured_workers,
                    tokenizer_fingerprint=tokenizer.fingerprint if tokenizer is not None else "",
                    fallback_model=route.fallback,
                    queued_requests=status.queued_requests,
                    fallback_enabled=bool(route.fallback) and route.fallback_enabled,
                    kv_cache_tokens=status.kv_cache_tokens,
                    memory=status.memory,
                    native_kernels=status.native_kernels,
                    model_family=status.model_family,
                    native_paths=status.native_paths,
                    weights_format=status.weights_format,
                )
            )
        routes = {info.name: info for info in models}
        for route, adapter in await served_adapters(self._router):
            entry = gateway_pb2.ModelInfo()
            entry.CopyFrom(routes[route.name])
            entry.name, entry.base_model = f"{route.name}:{adapter.name}", route.name
            entry.adapter, entry.lora_rank = adapter.name, adapter.rank
            models.append(entry)
        tenants = self._pipeline.tenants.status()
        for route in self._router.routes():
            for tenant in tenants:
                tenant.queued += route.queued_by_tenant()[tenant.name]
        return gateway_pb2.ListModelsResponse(
            models=models, default_model=self._default_model, tenants=tenants
        )


class GatewayServer:
    """A running gateway: its server, tokenizer connection, links and readiness."""

    def __init__(self, settings: GatewaySettings, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.tracing = tracing or Tracing.off()
        self.tokenizer = TokenizerClient(settings, self._health_changed)
        self.router = Router(settings, self.tokenizer, self._health_changed)
        self.batcher = TokenizeBatcher(self.tokenizer, settings.max_batch_delay_ms, settings.max_batch_size)
        self.pipeline = Pipeline(settings, self.router, self.batcher, self.tokenizer, self.tracing)
        self.running: RunningServer | None = None
        self.address = ""
        """host:port the server is bound to."""
        self.http: HttpFrontDoor | None = None
        """The OpenAI-compatible HTTP API when http_listen is set."""
        self._health_dirty = asyncio.Event()
        self._ready_changed = asyncio.Event()
        self._serving = False
        self._draining = False
        self._health_task: asyncio.Task[None] | None = None

    @property
    def serving(self) -> bool:
        return self._serving

    def _routes_served(self) -> bool:
        """Every route has a ready worker, or a fallback that has one and may stand in for it."""
        for route in self.router.routes():
            if route.available():
                continue
            if not (
                route.fallback and route.fallback_enabled and self.router.route(route.fallback).available()
            ):
                return False
        return True

    def _load(self) -> list[tuple[str, int, int]]:
        """(model, queued, in flight) per route, for the /metrics gauges."""
        return [
            (route.name, route.queued_requests, sum(link.open_requests for link in route.links))
            for route in self.router.routes()
        ]

    def _health_changed(self) -> None:
        self._health_dirty.set()

    async def _follow_health(self) -> None:
        assert self.running is not None
        while True:
            await self._health_dirty.wait()
            self._health_dirty.clear()
            serving = not self._draining and self.tokenizer.reachable and self._routes_served()
            if serving != self._serving:
                self._serving = serving
                await self.running.set_serving(serving)
                log.info("gateway is %s", "SERVING" if serving else "NOT_SERVING")
                self._ready_changed.set()
                self._ready_changed = asyncio.Event()

    async def start(self, announce_file: Path | None) -> None:
        servicer = GatewayServicer(
            self.pipeline,
            self.router,
            self.tokenizer,
            self.settings.default_route,
            self.settings.stream_idle_timeout_s,
            self.settings.tenant_keys(),
        )
        if self.settings.http_listen:
            self.http = HttpFrontDoor(self.settings, self.pipeline, self.router, lambda: self._serving)
            http_address = await self.http.start()
            if announce_file is not None:  # before the gRPC address, which a reader takes as complete
                announce(announce_file.with_name(announce_file.name + ".http"), http_address)
        self.running = await start_server(
            self.settings.listen,
            register=[lambda server: add_servicer(server, servicer, SERVICE)],
            service_names=[SERVICE_NAME],
            max_message_bytes=self.settings.max_message_bytes,
            limits=self.settings.rpc_limits,
            announce_file=announce_file,
            health_listen=self.settings.health_listen,
            tls=self.settings.tls,
            interceptors=[ApiKeyInterceptor(keys)] if (keys := self.settings.accepted_keys()) else [],
        )
        self.address = self.running.address
        self._health_task = asyncio.create_task(self._follow_health(), name="gateway-health")
        ROUTER_GAUGES.add(self._load)
        self.tokenizer.start()
        self.router.start()
        log.info(
            "gateway listening on %s%s, routes: %s",
            self.address,
            f" (HTTP API on {self.http.address})" if self.http is not None else "",
            ", ".join(self.router.models),
        )

    async def wait_ready(self, timeout: float) -> bool:
        """Wait until health is SERVING; False when `timeout` seconds passed first."""
        deadline = time.monotonic() + timeout
        while not self._serving:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready_changed.wait(), remaining)
        return True

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, refuse new calls, let running ones finish for `grace` seconds, close links."""
        if self._draining:
            return
        grace = self.settings.shutdown_grace_s if grace is None else grace
        self._draining = True
        self._serving = False
        if self.running is not None:
            await self.running.set_serving(False)
            # Both front doors drain at once, within the one grace period, before the links close. gRPC
            # stops on this task, as it did alone: run from a task of its own (gather), it went on
            # taking new calls after NOT_SERVING (tests/reliability/test_s04_graceful_shutdown.py).
            http_stopped = asyncio.ensure_future(self.http.stop(grace)) if self.http is not None else None
            await self.running.stop(grace)
            if http_stopped is not None:
                await http_stopped
        ROUTER_GAUGES.remove(self._load)
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        await self.batcher.close()
        await self.router.close()
        await self.tokenizer.close()


async def start(
    settings: GatewaySettings, announce_file: Path | None = None, tracing: Tracing | None = None
) -> GatewayServer:
    """Bind and start connecting; returns at once with health NOT_SERVING until the stack is ready."""
    server = GatewayServer(settings, tracing or Tracing.off())
    await server.start(announce_file)
    return server


async def serve(settings: GatewaySettings, announce_file: Path | None, tracing: Tracing) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully."""
    stopping = shutdown_event()
    server = await start(settings, announce_file, tracing)
    ready = asyncio.create_task(server.wait_ready(settings.connect_timeout_s))
    stop = asyncio.create_task(stopping.wait())
    await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and not ready.result():
        log.error(
            "not ready after %.0f s: tokenizer %s, routes: %s; still trying (health NOT_SERVING)",
            settings.connect_timeout_s,
            "serving" if server.tokenizer.reachable else "unreachable",
            "; ".join(
                f"{link.model}@{link.address}: {'ready' if link.ready else link.not_ready_reason}"
                for link in server.router.links()
            ),
        )
    ready.cancel()
    await stop
    log.info("gateway stopping: draining for up to %.0f s", settings.shutdown_grace_s)
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m gateway [--config PATH] [--announce-file PATH]`."""
    return run_service(
        GatewaySettings,
        serve,
        argv,
        prog="python -m gateway",
        description=__doc__,
        service_name="strata-gateway",
    )
