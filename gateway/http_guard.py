"""The HTTP API's bounds on connections, below the app: uvicorn's HTTP/1.1 protocol (h11) with two
guards a shared server needs against clients that flood it or trickle bytes.

- **Connections**: past `http_max_connections` open at once, a connection's requests are answered
  503 with an OpenAI error body, Retry-After and `connection: close` (uvicorn's own cap answers in
  plain text, which SDKs cannot parse, so it is not used).
- **Slow heads** (slowloris): a request's head (request line and headers) must arrive within
  `http_header_timeout_s` of the connection opening or of its first byte; past it the connection is
  answered 408 and closed. The wait between keep-alive requests is uvicorn's `http_keep_alive_s`.

Each connection's kernel send buffer is fixed at SEND_BUFFER_BYTES rather than autotuned (up to 4
MiB on Linux): a client that stops reading then pins little memory, and its stream's writes stop
completing soon enough for the endpoint's idle timeout to see it. A completions stream needs kilobytes
a second, far below what that buffer carries even over a slow link.

A slow body and a stream its client stops reading are the endpoints' to bound (http_exchange.py:
http_body_timeout_s, stream_idle_timeout_s). This module must not read requests' contents nor know
the pipeline.
"""

from __future__ import annotations

import json
import logging
import socket
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.openai_errors import HttpError, over_connections, too_slow

if TYPE_CHECKING:
    import asyncio

    from gateway.settings import GatewaySettings

log = logging.getLogger("strata.gateway")

SEND_BUFFER_BYTES = 128 * 1024


def guarded_protocol(settings: GatewaySettings) -> type[H11Protocol]:
    """uvicorn's `http` protocol class for a front door with `settings`' bounds."""

    class Guarded(GuardedH11):
        max_connections = settings.http_max_connections
        header_timeout_s = settings.http_header_timeout_s
        retry_after_s = settings.overload_retry_after_s

    return Guarded


class GuardedH11(H11Protocol):
    """One HTTP/1.1 connection, bounded; the bounds are class attributes set by guarded_protocol."""

    max_connections: int
    header_timeout_s: float
    retry_after_s: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        if len(self.connections) > self.max_connections:
            error = over_connections(self.max_connections, self.retry_after_s)
            self.app = error.response()  # an ASGI app: every request on it gets the 503
            log.warning("HTTP connection over http_max_connections=%d answered 503", self.max_connections)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # h11 leaves IDLE for the client once it has parsed a whole request head.
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()
        elif self._head_timer is None:
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        """No whole request head in time: 408 written straight to the socket (h11 sends a response
        only to a request it has parsed), then the connection is closed."""
        self._head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        error = too_slow("request head", "http_header_timeout_s", self.header_timeout_s)
        log.warning("HTTP client sent no whole request head in %gs; closed", self.header_timeout_s)
        self.transport.write(_raw(error))
        self.transport.close()


def _raw(error: HttpError) -> bytes:
    """`error` as a whole HTTP/1.1 response (too_slow's headers close the connection)."""
    body = json.dumps(error.body()).encode()
    headers = {"content-type": "application/json", **error.headers, "content-length": str(len(body))}
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body
