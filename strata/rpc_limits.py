"""Bounds every Strata gRPC server keeps against clients that flood it or misbehave.

A server holds at most `max_concurrent_rpcs` calls at once (health checks and reflection are not
counted, so probes answer through a flood); one more is refused at once with RESOURCE_EXHAUSTED,
a message naming the limit, and a retry hint (strata.status's RetryInfo and pushback). Calls that
carry the same `authorization` metadata (one API key) hold at most `max_concurrent_rpcs_per_key` of
them, so one caller's flood leaves the rest of the server's calls to the others; calls without the
header share the server's limit only. One HTTP/2
connection holds at most `max_streams_per_connection` streams (its SETTINGS_MAX_CONCURRENT_STREAMS:
a well-behaved client queues the rest, one that ignores the setting has them reset). A client that
pings more often than the server allows (strata.rpc's MIN_RECV_PING_INTERVAL_MS) more than
`max_ping_strikes` times in a row is sent GOAWAY. Message sizes are each service's own
`max_message_bytes`. This module must not decide anything about a call it lets through.

grpc's own `maximum_concurrent_rpcs` is not used: it counts health checks too, so a flood would fail
the readiness probes that should route traffic away from it, and its refusal carries no retry hint.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection
from pydantic import BaseModel, ConfigDict, model_validator

from strata.status import ResourceExhausted, abort

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

_UNCOUNTED = (f"/{health.SERVICE_NAME}/", f"/{reflection.SERVICE_NAME}/")


class RpcLimits(BaseModel):
    """A gRPC server's bounds on what its clients may hold (docs/security.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_concurrent_rpcs: int = 1024
    """Calls in progress at once (health checks and reflection not counted); one more is refused with
    RESOURCE_EXHAUSTED and a retry hint."""
    max_concurrent_rpcs_per_key: int = 512
    """Of those, the calls that carry one `authorization` value (an API key) at once; one more of that
    key is refused the same way, while other keys' calls still come in."""
    max_streams_per_connection: int = 256
    """Streams one HTTP/2 connection may hold open (SETTINGS_MAX_CONCURRENT_STREAMS)."""
    max_ping_strikes: int = 2
    """Pings closer together than the server allows, in a row, before it closes the connection with
    GOAWAY (too_many_pings)."""
    busy_retry_after_s: float = 1.0
    """The retry hint sent with a call refused by max_concurrent_rpcs."""

    @model_validator(mode="after")
    def _check(self) -> RpcLimits:
        names = ("max_concurrent_rpcs", "max_concurrent_rpcs_per_key", "max_streams_per_connection")
        for name in (*names, "max_ping_strikes"):
            if getattr(self, name) < 1:
                raise ValueError(f"rpc_limits.{name}={getattr(self, name)} must be >= 1, e.g. 256")
        if not self.busy_retry_after_s > 0:
            raise ValueError(f"rpc_limits.busy_retry_after_s={self.busy_retry_after_s} must be > 0, e.g. 1")
        return self

    def server_options(self) -> list[tuple[str, int]]:
        """The gRPC server arguments for the per-connection bounds."""
        return [
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
        ]


class RpcCap(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Counts the calls a server is running, in all and by key, and refuses those past the limits."""

    def __init__(self, limits: RpcLimits) -> None:
        self._limit = limits.max_concurrent_rpcs
        self._key_limit = limits.max_concurrent_rpcs_per_key
        self._retry_after_s = limits.busy_retry_after_s
        self._running = 0
        """Calls counted and not yet finished."""
        self._by_key: dict[str, int] = {}
        """Of those, the calls of each `authorization` value; a key leaves when its last call ends."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_UNCOUNTED):
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        key = next((str(value) for name, value in metadata if name == "authorization"), "")
        return self._counted(handler, key)

    async def _enter(self, context: grpc.aio.ServicerContext[Any, Any], key: str) -> None:
        """Count the call in, or end it RESOURCE_EXHAUSTED when the server or its key is full. No
        await comes between the check and the count, so two arrivals cannot both take the last place."""
        held = self._by_key.get(key, 0)
        if self._running >= self._limit:
            text = f"this server is running {self._running} calls, its limit (rpc_limits.max_concurrent_rpcs"
            await self._refuse(context, f"{text}={self._limit})")
        if key and held >= self._key_limit:
            text = f"this key has {held} calls running here, its limit"
            await self._refuse(context, f"{text} (rpc_limits.max_concurrent_rpcs_per_key={self._key_limit})")
        self._running += 1
        if key:
            self._by_key[key] = held + 1

    async def _refuse(self, context: grpc.aio.ServicerContext[Any, Any], text: str) -> None:
        message = f"{text}; retry after {self._retry_after_s:g} s"
        await abort(context, ResourceExhausted(message, self._retry_after_s))

    def _leave(self, key: str) -> None:
        self._running -= 1
        if key:
            held = self._by_key.pop(key) - 1
            if held:
                self._by_key[key] = held

    def _counted(self, handler: grpc.RpcMethodHandler, key: str) -> grpc.RpcMethodHandler:
        """A handler of the same kind as `handler` that runs it counted, under `key`."""
        parse, serialize = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary is not None:
            unary = self._unary(handler.unary_unary, key)
            return grpc.unary_unary_rpc_method_handler(unary, parse, serialize)
        if handler.stream_unary is not None:
            unary = self._unary(handler.stream_unary, key)
            return grpc.stream_unary_rpc_method_handler(unary, parse, serialize)
        if handler.unary_stream is not None:
            stream = self._stream(handler.unary_stream, key)
            return grpc.unary_stream_rpc_method_handler(stream, parse, serialize)
        stream = self._stream(handler.stream_stream, key)
        return grpc.stream_stream_rpc_method_handler(stream, parse, serialize)

    def _unary(self, behavior: Callable[..., Awaitable[Any]], key: str) -> Callable[..., Awaitable[Any]]:
        async def counted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await self._enter(context, key)
            try:
                return await behavior(request, context)
            finally:
                self._leave(key)

        return counted

    def _stream(self, behavior: Callable[..., Any], key: str) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):
            return self._unary(behavior, key)  # a handler that writes with context.write and returns

        async def counted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            await self._enter(context, key)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                self._leave(key)

        return counted
