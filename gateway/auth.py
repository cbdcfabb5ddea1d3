"""API keys: every call to the gateway but a health check must carry `authorization: Bearer <key>`.

An interceptor reads the metadata before the handler runs; a missing, malformed or unknown key gets
UNAUTHENTICATED at once, saying what to send, and the request never reaches validation or admission.
Keys are compared in constant time against every accepted key (no early exit), so the answer's
timing says nothing about how much of a key matched. With no keys configured there is no
interceptor at all. This module must not know the request path nor log a key.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

import grpc

from strata.rpc import HEALTH_SERVICE

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

UNAUTHENTICATED_MESSAGE = "missing or unknown API key: send the metadata `authorization: Bearer <key>`"
_PREFIX = b"Bearer "


def key_matches(header: str | bytes | None, keys: tuple[bytes, ...]) -> bool:
    """Whether `header` is `Bearer <one of keys>`, compared in constant time against each key."""
    if header is None:
        return False
    raw = header.encode() if isinstance(header, str) else header
    token = raw[len(_PREFIX) :] if raw.startswith(_PREFIX) else b""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched and bool(token)


def tenant_of(header: str | bytes | None, keys: tuple[tuple[bytes, str], ...], default: str) -> str:
    """The tenant whose key `header` carries (`Bearer <key>`), compared in constant time against every
    key; `default` when it carries none of them (only reachable when no key is required)."""
    raw = b"" if header is None else header.encode() if isinstance(header, str) else header
    token = raw[len(_PREFIX) :] if raw.startswith(_PREFIX) else b""
    found = default
    for key, tenant in keys:
        if hmac.compare_digest(token, key) and token:
            found = tenant
    return found


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses calls without an accepted key; health checks pass without one (probes have none)."""

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self._keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if key_matches(metadata.get("authorization"), self._keys):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        yield None  # never reached (abort raises); it makes this an async generator like the original

    parse, serialize = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, parse, serialize)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, parse, serialize)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, parse, serialize)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, parse, serialize)
