"""What every HTTP endpoint shares: the body read within its bounds, the deadline header, the pipeline's
Incoming, the disconnect watch, Server-Sent Events, and the ASGI shape of an endpoint (`Endpoint`).

`read_body` refuses a body over the limit (413) or too slow to arrive (408); `deadline_ms` reads the
`x-strata-timeout-ms` header; `http_incoming` makes the pipeline's Incoming (protocol "http", the
tenant the API-key middleware found, the caller's W3C trace context). From the moment the body is read,
`unless_disconnected` waits for the client to disconnect and, when it does, cancels the request's task
wherever it is (queued, prefilling, streaming), which closes the pipeline and so cancels the request on
the worker. `send_stream` sends a stream's events and cancels it the same way when its client takes
none for stream_idle_timeout_s. `Endpoint` is one POST endpoint: read and parse (`prepare`, with
`_read`: the body within its bounds, parsed by the API's schema, and the deadline; `_incoming`: the
chat request every API is read as, onto the pipeline), refuse in the API's own error shape (`shape`),
answer unless the client left (`respond`), count the status. This module must not know an API's
fields nor decide statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from sse_starlette.event import ServerSentEvent
from starlette.requests import ClientDisconnect, Request

from gateway.http_auth import answer_refusal, tenant
from gateway.metrics import HTTP_RESPONSES, STUCK_STREAMS
from gateway.openai_errors import HttpError, from_validation, too_large, too_slow
from gateway.openai_mapping import to_generate_request
from gateway.request_ids import new_request_id
from gateway.request_trace import TRACE_KEYS
from gateway.request_values import Incoming

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Callable, Coroutine

    from starlette.responses import JSONResponse
    from starlette.types import Receive, Scope, Send

    from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
    from gateway.pipeline import Pipeline
    from gateway.router import Router
    from gateway.settings import GatewaySettings
    from strata.v1 import gateway_pb2

Body = TypeVar("Body", bound=BaseModel)

TIMEOUT_HEADER = "x-strata-timeout-ms"
"""The request's deadline, in milliseconds from its arrival (gRPC's call deadline, over HTTP)."""

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),
]


def event(payload: dict[str, Any]) -> bytes:
    """One SSE `data:` event holding `payload` as compact JSON."""
    return ServerSentEvent(data=json.dumps(payload, separators=(",", ":")), sep="\n").encode()


def named_event(kind: str, payload: dict[str, Any]) -> bytes:
    """One SSE event named `kind` (its `event:` line) holding `payload` as compact JSON."""
    return ServerSentEvent(data=json.dumps(payload, separators=(",", ":")), event=kind, sep="\n").encode()


async def send_stream(
    events: AsyncGenerator[bytes, None], send: Send, endpoint: str, idle_s: float, model: Callable[[], str]
) -> None:
    """Send a stream: its 200 headers, then each event. A client that takes no event for `idle_s` loses
    the stream: it is counted stuck under `model()` and its connection closes unfinished, and the caller
    leaving its pipeline's block cancels the request on the worker."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    HTTP_RESPONSES.labels(endpoint, "200").inc()
    async with contextlib.aclosing(events):
        async for data in events:
            try:
                async with asyncio.timeout(idle_s):
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            except TimeoutError:
                STUCK_STREAMS.labels(model()).inc()
                return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class Endpoint:
    """One POST endpoint as an ASGI app: `prepare` reads the request into the pipeline's Incoming (or
    raises HttpError), `respond` answers it (None once a stream has sent its own answer), `shape` gives
    a refusal the API's error shape."""

    endpoint = ""

    def __init__(self, settings: GatewaySettings, pipeline: Pipeline, router: Router) -> None:
        self._settings = settings
        self._pipeline = pipeline
        self._router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            incoming, body = await self.prepare(Request(scope, receive))
        except HttpError as error:
            await answer_refusal(self.shape(error), self.endpoint, scope, receive, send)
            return
        except ClientDisconnect:
            return  # gone before its body arrived: nothing was started for it
        response = await unless_disconnected(self.respond(incoming, body, send), receive)
        if response is not None:
            await response(scope, receive, send)
            HTTP_RESPONSES.labels(self.endpoint, str(response.status_code)).inc()

    async def prepare(self, request: Request) -> tuple[Incoming, Any]:
        """The pipeline's Incoming and the parsed body."""
        raise NotImplementedError

    async def respond(self, incoming: Incoming, body: Any, send: Send) -> JSONResponse | None:
        raise NotImplementedError

    def shape(self, error: HttpError) -> HttpError:
        return error

    async def _read(self, request: Request, schema: type[Body]) -> tuple[Body, int]:
        """The body, read within max_message_bytes and http_body_timeout_s and parsed by `schema` (400
        naming the field), and the deadline (unix ms) of the timeout header, from the arrival."""
        arrival = time.time()
        deadline = deadline_ms(request.headers.get(TIMEOUT_HEADER), arrival)
        raw = await read_body(request, self._settings.max_message_bytes, self._settings.http_body_timeout_s)
        try:
            return schema.model_validate_json(raw), deadline
        except ValidationError as error:
            raise from_validation(error) from error

    def _incoming(
        self, chat: ChatCompletionRequest | CompletionRequest, request: Request, deadline: int
    ) -> Incoming:
        """The pipeline's Incoming for the chat (or text) completion request the body is read as."""
        return http_incoming(to_generate_request(chat, self._settings, self._context), request, deadline)

    def _context(self, model: str) -> int | None:
        """A served model's context length when known; None for a name no route serves (the
        pipeline's validation answers 404 for it)."""
        return self._router.max_model_len(model) if model in self._router.models else None


def http_incoming(generate: gateway_pb2.GenerateRequest, request: Request, deadline: int) -> Incoming:
    """The pipeline's Incoming for an HTTP request: a new request id (known before the first chunk:
    every chunk's), the caller's tenant and W3C trace context, the deadline (unix ms, 0: none)."""
    generate.request_id = new_request_id()
    trace = {key: value for key in TRACE_KEYS if (value := request.headers.get(key)) is not None}
    return Incoming(
        generate,
        protocol="http",
        tenant=tenant(request.scope),
        deadline_unix_ms=deadline,
        trace_context=trace,
    )


def deadline_ms(header: str | None, arrival: float) -> int:
    """The absolute deadline (unix ms) of the timeout header; 0 when absent."""
    if header is None:
        return 0
    try:
        timeout_ms = float(header)
    except ValueError:
        timeout_ms = -1.0
    if not timeout_ms > 0:
        raise HttpError(
            400,
            f"{TIMEOUT_HEADER}: {header!r} must be a positive number of milliseconds, e.g. 30000",
            param=TIMEOUT_HEADER,
            code="invalid_value",
        )
    return int(arrival * 1000 + timeout_ms)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused with 413 as soon as it is known to be over `limit` bytes, and with 408 when
    it has not all arrived within `timeout_s` (a client trickling bytes holds a request slot)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_large(limit)
                parts.append(part)
    except TimeoutError:
        raise too_slow("request body", "http_body_timeout_s", timeout_s) from None
    return b"".join(parts)


async def unless_disconnected(answer: Coroutine[Any, Any, JSONResponse | None], receive: Receive) -> Any:
    """`answer`'s result, or None once the client disconnected (`answer` is then cancelled, which
    closes its pipeline and so cancels the request on the worker)."""
    work = asyncio.ensure_future(answer)
    watch = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        watch.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        return None
    return work.result()


async def _disconnect(receive: Receive) -> None:
    """Returns when the server reports the client gone (or the response complete)."""
    while (await receive())["type"] != "http.disconnect":
        continue
