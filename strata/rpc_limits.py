"""Bounds every Strata gRPC server keeps against clients that flood it or misbehave.

A server holds at most `max_concurrent_rpcs` calls at once (health checks and reflection are not
counted, so probes answer through a flood); one more is refused at once with RESOURCE_EXHAUSTED,
a message naming the limit, and a retry hint (strata.status's RetryInfo and pushback). One HTTP/2
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
    max_streams_per_connection: int = 256
    """Streams one HTTP/2 connection may hold open (SETTINGS_MAX_CONCURRENT_STREAMS)."""
    max_ping_strikes: int = 2
    """Pings closer together than the server allows, in a row, before it closes the connection with
    GOAWAY (too_many_pings)."""
    busy_retry_after_s: float = 1.0
    """The retry hint sent with a call refused by max_concurrent_rpcs."""

    @model_validator(mode="after")
    def _check(self) -> RpcLimits:
        for name in ("max_concurrent_rpcs", "max_streams_per_connection", "max_ping_strikes"):
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
    """Counts the calls a server is running and refuses those past max_concurrent_rpcs."""

    def __init__(self, limits: RpcLimits) -> None:
        self._limit = limits.max_concurrent_rpcs
        self._retry_after_s = limits.busy_retry_after_s
        self._running = 0
        """Calls counted and not yet finished."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_UNCOUNTED):
            return handler
        return self._counted(handler)

    async def _enter(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Count the call in, or end it RESOURCE_EXHAUSTED when the server is full. No await comes
        between the check and the count, so two arrivals cannot both take the last place."""
        if self._running >= self._limit:
            message = (
                f"this server is running {self._running} calls, its limit (rpc_limits.max_concurrent_rpcs="
                f"{self._limit}); retry after {self._retry_after_s:g} s"
            )
            await abort(context, ResourceExhausted(message, self._retry_after_s))
        self._running += 1

    def _counted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """A handler of the same kind as `handler` that runs it counted."""
        parse, serialize = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary), parse, serialize)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary), parse, serialize)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream), parse, serialize)
        return grpc.stream_stream_rpc_method_handler(self._stream(handler.stream_stream), parse, serialize)

    def _unary(self, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def counted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await self._enter(context)
            try:
                return await behavior(request, context)
            finally:
                self._running -= 1

        return counted

    def _stream(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):
            return self._unary(behavior)  # a handler that writes with context.write and returns

        async def counted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            await self._enter(context)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                self._running -= 1

        return counted
