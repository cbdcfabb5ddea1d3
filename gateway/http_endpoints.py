"""POST /v1/chat/completions and POST /v1/completions: one HTTP request through the pipeline.

Each endpoint is an ASGI app (http_exchange.py's Endpoint) behind the API-key middleware (http_auth.py,
which names the tenant). It reads the body up to max_message_bytes (413 beyond) within
http_body_timeout_s (408 past it), parses it (openai_schema.py), builds the pipeline's Incoming with
the deadline of the `x-strata-timeout-ms` header, and answers: a whole JSON response, or Server-Sent
Events (`data:` chunks, then `data: [DONE]`). A stream's headers go out with its first chunk, so a
request refused before any token gets its real status (429, 503, ...); a failure after that is an
error event. A thinking model's reasoning (gateway/reasoning.py) is a chat answer's
`reasoning_content`, streamed before the answer. A client that disconnects, or stops reading a
stream, loses its request as http_exchange.py says. This module must not hold request logic (the
pipeline does) nor map errors (openai_errors.py).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from sse_starlette.event import ServerSentEvent
from starlette.responses import JSONResponse

from gateway.errors import GatewayError
from gateway.http_exchange import (
    Endpoint,
    event,
    send_stream,
)
from gateway.openai_errors import from_gateway
from gateway.openai_logprobs import prompt_logprobs
from gateway.openai_mapping import FINISH_REASONS, Reply, extension, headers
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.reasoning import ReasoningSplit
from gateway.tool_calls import answered_with_calls
from gateway.tool_stream import CallEnd, ToolStream

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from starlette.requests import Request
    from starlette.types import Send

    from gateway.pipeline import Pipeline
    from gateway.request_values import Chunk, Incoming
    from gateway.router import Router
    from gateway.settings import GatewaySettings
    from gateway.tool_stream import Piece
    from strata.v1 import gateway_pb2


DONE = ServerSentEvent(data="[DONE]", sep="\n").encode()


class Completions(Endpoint):
    """The ASGI app of one completions endpoint (chat or text)."""

    def __init__(self, chat: bool, settings: GatewaySettings, pipeline: Pipeline, router: Router) -> None:
        self._chat = chat
        self._schema: type[ChatCompletionRequest | CompletionRequest] = (
            ChatCompletionRequest if chat else CompletionRequest
        )
        self.endpoint = "chat.completions" if chat else "completions"
        super().__init__(settings, pipeline, router)

    async def prepare(self, request: Request) -> tuple[Incoming, ChatCompletionRequest | CompletionRequest]:
        body, deadline = await self._read(request, self._schema)
        return self._incoming(body, request, deadline), body

    async def respond(
        self, incoming: Incoming, body: ChatCompletionRequest | CompletionRequest, send: Send
    ) -> JSONResponse | None:
        token_field = body.token_limit()[0]
        if body.stream:
            return await self._stream(incoming, body, token_field, send)
        return await self._whole(incoming, token_field)

    async def _whole(self, incoming: Incoming, token_field: str) -> JSONResponse:
        reply = Reply(
            self._chat, incoming.request.model or self._settings.default_route, incoming.request.sampling
        )
        try:
            async with contextlib.aclosing(self._pipeline.run(incoming)) as chunks:
                async for chunk in chunks:
                    if chunk.final is not None:
                        reply.thinks = self._chat and self._pipeline.thinks(chunk.final.model)
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
            held = ToolStream(incoming.request)
            events = self._events(reply, first, chunks, body.include_usage, token_field, held)
            idle = self._settings.stream_idle_timeout_s
            await send_stream(events, send, self.endpoint, idle, lambda: reply.model)
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
        thinks = self._chat and self._pipeline.thinks(first.model or reply.model)
        splits: dict[int, ReasoningSplit] = {}
        try:
            while chunk is not None:
                reply.model = chunk.model or reply.model
                final = chunk.final
                opening = self._chat and chunk.index not in opened
                split = splits.setdefault(chunk.index, ReasoningSplit(thinks))
                last_of_sample = final is not None or chunk.sample_final is not None
                reasoning, answer = split.finish(chunk.text) if last_of_sample else split.take(chunk.text)
                if reasoning:
                    yield event(reply.reasoning_chunk(reasoning, opening, chunk.index))
                    opened.add(chunk.index)
                    opening = False
                if final is None:
                    done = chunk.sample_final
                    # Tools take one sample (check_samples refuses n > 1 with them): `held` is sample 0's.
                    pieces = held.take(answer)
                    text = "".join(piece for piece in pieces if isinstance(piece, str))
                    if text or chunk.logprobs or done is not None or opening:
                        finish = None if done is None else _finish(done)
                        yield event(reply.chunk(text, finish, opening, chunk.logprobs, chunk.index))
                        opened.add(chunk.index)
                    for data in _calls(reply, pieces):
                        yield data
                    chunk = await anext(chunks, None)
                    continue
                reply.model = final.model
                if final.choices:  # n > 1: every sample's last chunk has gone with its finish reason
                    last = reply.empty_chunk()
                else:
                    pieces = held.finish(answer, final)
                    calls = _calls(reply, pieces)
                    if calls and opening:
                        yield event(reply.chunk("", None, True))
                        opening = False
                    for data in calls:
                        yield data
                    text = "".join(piece for piece in pieces if isinstance(piece, str))
                    finish = "tool_calls" if answered_with_calls(final) else _finish(final)
                    last = reply.chunk(text, finish, opening, chunk.logprobs)
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


def _calls(reply: Reply, pieces: list[Piece]) -> list[bytes]:
    """The chunks of the calls' pieces: a call's start, then its arguments' fragments."""
    return [event(reply.call_chunk(piece)) for piece in pieces if not isinstance(piece, (str, CallEnd))]


def _finish(final: gateway_pb2.GenerateResponse) -> str:
    return FINISH_REASONS.get(final.finish_reason, "stop")
