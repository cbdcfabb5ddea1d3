"""POST /v1/chat/completions and POST /v1/completions: one HTTP request through the pipeline.

Each endpoint is an ASGI app behind the API-key middleware (http_auth.py, which names the tenant).
It reads the body up to max_message_bytes (413 beyond) within http_body_timeout_s (408 past it),
parses it (openai_schema.py), builds the pipeline's Incoming with protocol "http", the caller's W3C
trace context and the deadline of the `x-strata-timeout-ms` header, and answers: a whole JSON
response, or Server-Sent Events (`data:` chunks, then `data: [DONE]`). A stream's headers go out
with its first chunk, so a request refused before any token gets its real status (429, 503, ...); a
failure after that is an error event.

From the moment the body is read, a watcher waits for the client to disconnect; when it does, the
request's task is cancelled wherever it is (queued, prefilling, streaming; stream or not), which
closes the pipeline and so cancels the request on the worker. A stream whose client takes no event
for stream_idle_timeout_s is cancelled the same way. This module must not hold request logic (the
pipeline does) nor map errors (openai_errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sse_starlette.event import ServerSentEvent
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from gateway.errors import GatewayError
from gateway.http_auth import answer_refusal, tenant
from gateway.metrics import HTTP_RESPONSES, STUCK_STREAMS
from gateway.openai_errors import HttpError, from_gateway, from_validation, too_large, too_slow
from gateway.openai_logprobs import prompt_logprobs
from gateway.openai_mapping import FINISH_REASONS, Reply, extension, headers, to_generate_request
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.openai_tools import ToolStream
from gateway.request_ids import new_request_id
from gateway.request_trace import TRACE_KEYS
from gateway.request_values import Incoming

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Coroutine

    from starlette.types import Receive, Scope, Send

    from gateway.pipeline import Pipeline
    from gateway.request_values import Chunk
    from gateway.router import Router
    from gateway.settings import GatewaySettings
    from strata.v1 import gateway_pb2


TIMEOUT_HEADER = "x-strata-timeout-ms"
"""The request's deadline, in milliseconds from its arrival (gRPC's call deadline, over HTTP)."""
DONE = ServerSentEvent(data="[DONE]", sep="\n").encode()


def event(payload: dict[str, Any]) -> bytes:
    """One SSE `data:` event holding `payload` as compact JSON."""
    return ServerSentEvent(data=json.dumps(payload, separators=(",", ":")), sep="\n").encode()


class Completions:
    """The ASGI app of one completions endpoint (chat or text)."""

    def __init__(self, chat: bool, settings: GatewaySettings, pipeline: Pipeline, router: Router) -> None:
        self._chat = chat
        self._schema = ChatCompletionRequest if chat else CompletionRequest
        self.endpoint = "chat.completions" if chat else "completions"
        self._settings = settings
        self._pipeline = pipeline
        self._router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.time()
        request = Request(scope, receive)
        try:
            incoming, body = await self._incoming(request, arrival)
        except HttpError as error:
            await self._error(error, scope, receive, send)
            return
        except ClientDisconnect:
            return  # gone before its body arrived: nothing was started for it
        token_field = body.token_limit()[0]
        if body.stream:
            answer = self._stream(incoming, body, token_field, send)
        else:
            answer = self._whole(incoming, token_field)
        response = await unless_disconnected(answer, receive)
        if response is not None:
            await response(scope, receive, send)
            HTTP_RESPONSES.labels(self.endpoint, str(response.status_code)).inc()

    async def _incoming(
        self, request: Request, arrival: float
    ) -> tuple[Incoming, ChatCompletionRequest | CompletionRequest]:
        deadline = deadline_ms(request.headers.get(TIMEOUT_HEADER), arrival)
        raw = await read_body(request, self._settings.max_message_bytes, self._settings.http_body_timeout_s)
        try:
            body = self._schema.model_validate_json(raw)
        except ValidationError as error:
            raise from_validation(error) from error
        generate = to_generate_request(body, self._settings, self._context)
        return http_incoming(generate, request, deadline), body

    def _context(self, model: str) -> int | None:
        """A served model's context length when known; None for a name no route serves (the
        pipeline's validation answers 404 for it)."""
        return self._router.max_model_len(model) if model in self._router.models else None

    async def _whole(self, incoming: Incoming, token_field: str) -> JSONResponse:
        reply = Reply(
            self._chat, incoming.request.model or self._settings.default_route, incoming.request.sampling
        )
        try:
            async with contextlib.aclosing(self._pipeline.run(incoming)) as chunks:
                async for chunk in chunks:
                    if chunk.final is not None:
                        return JSONResponse(reply.whole(chunk.final), headers=headers(chunk.final))
        except GatewayError as error:
            return from_gateway(error, token_field).response()
        raise AssertionError("the pipeline ended without a final chunk")

    async def _stream(
        self,
        incoming: Incoming,
        body: ChatCompletionRequest | CompletionRequest,
        token_field: str,
        send: Send,
    ) -> JSONResponse | None:
        """Send the stream itself once its first chunk is there; a JSON error when none came."""
        reply = Reply(
            self._chat, incoming.request.model or self._settings.default_route, incoming.request.sampling
        )
        reply.started(incoming.request.request_id, reply.model)
        async with contextlib.aclosing(self._pipeline.run(incoming)) as chunks:
            try:
                first = await anext(chunks)
            except GatewayError as error:
                return from_gateway(error, token_field).response()
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            HTTP_RESPONSES.labels(self.endpoint, "200").inc()
            held = ToolStream(incoming.request)
            events = self._events(reply, first, chunks, body.include_usage, token_field, held)
            idle = self._settings.stream_idle_timeout_s
            async with contextlib.aclosing(events):
                async for data in events:
                    try:
                        async with asyncio.timeout(idle):
                            await send({"type": "http.response.body", "body": data, "more_body": True})
                    except TimeoutError:
                        # Closing the pipeline (leaving this block) cancels the request on the worker;
                        # the connection closes unfinished, which is all a reader that reads nothing gets.
                        STUCK_STREAMS.labels(reply.model).inc()
                        return None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return None

    async def _events(
        self,
        reply: Reply,
        first: Chunk,
        chunks: AsyncGenerator[Chunk, None],
        include_usage: bool,
        token_field: str,
        held: ToolStream,
    ) -> AsyncGenerator[bytes, None]:
        chunk: Chunk | None = first
        opened: set[int] = set()
        try:
            while chunk is not None:
                reply.model = chunk.model or reply.model
                final = chunk.final
                opening = self._chat and chunk.index not in opened
                if final is None:
                    done = chunk.sample_final
                    # Tools take one sample (check_samples refuses n > 1 with them): `held` is sample 0's.
                    text = held.take(chunk.text)
                    if text or chunk.logprobs or done is not None or opening:
                        finish = None if done is None else _finish(done)
                        yield event(reply.chunk(text, finish, opening, chunk.logprobs, chunk.index))
                        opened.add(chunk.index)
                    chunk = await anext(chunks, None)
                    continue
                reply.model = final.model
                if final.choices:  # n > 1: every sample's last chunk has gone with its finish reason
                    last = reply.empty_chunk()
                elif final.tool_calls:
                    yield event(reply.tool_calls_chunk(final))
                    last = reply.chunk("", "tool_calls", opening)
                else:
                    last = reply.chunk(held.rest(chunk.text), _finish(final), opening, chunk.logprobs)
                if reply.prompt_logprobs and last["choices"]:
                    last["choices"][0]["prompt_logprobs"] = prompt_logprobs(final.prompt_logprobs)
                closing = reply.usage_chunk(final) if include_usage else last
                closing["strata"] = extension(final)
                if include_usage and last["choices"]:
                    yield event(last)
                yield event(closing)
                yield DONE
                return
        except GatewayError as error:
            yield event(from_gateway(error, token_field).body())

    async def _error(self, error: HttpError, scope: Scope, receive: Receive, send: Send) -> None:
        await answer_refusal(error, self.endpoint, scope, receive, send)


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),
]


def _finish(final: gateway_pb2.GenerateResponse) -> str:
    return FINISH_REASONS.get(final.finish_reason, "stop")


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
