"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API, through the pipeline.

Each endpoint is an ASGI app behind the API-key middleware (http_auth.py, which takes Anthropic's
`x-api-key` header as well as a bearer token). It requires the `anthropic-version` header (any value:
the answers have the shape of version 2023-06-01 and later), reads the body as the Chat Completions
front door does (http_exchange.py: size and time limits, the `x-strata-timeout-ms` deadline, the
disconnect watch and the idle-stream timeout), parses it (anthropic_schema.py) and maps it through the
Chat Completions request it is (openai_mapping.py), so both front doors run the same pipeline.

A whole answer is a `message`: its content a `text` block, or the `tool_use` blocks of the calls it
made, after a thinking model's `thinking` block (gateway/reasoning.py); `stop_reason` end_turn,
max_tokens, stop_sequence (with the string that matched) or tool_use; `usage` with the prompt tokens
the prefix cache served as `cache_read_input_tokens`. A stream is Anthropic's events: message_start,
a thinking block's thinking_delta deltas, a text block's content_block_start, text_delta deltas and
content_block_stop, each call's tool_use block as soon as its name is written with its arguments in
input_json_delta fragments as they are written (tool_stream.py), message_delta with the stop reason
and the usage, message_stop; a failure after the first event is an `error` event.
count_tokens answers `{"input_tokens": n}` as the model would be prompted, tools included. Errors
have Anthropic's shape and codes (anthropic_errors.py). This module must not hold request logic (the
pipeline does) nor decide statuses.
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from gateway.anthropic_errors import anthropic_error
from gateway.anthropic_schema import CountTokensRequest, MessagesRequest
from gateway.errors import GatewayError
from gateway.http_exchange import (
    Endpoint,
    named_event,
    send_stream,
)
from gateway.openai_errors import HttpError, from_gateway, from_validation
from gateway.openai_mapping import headers
from gateway.reasoning import ReasoningSplit
from gateway.tool_calls import answered_with_calls
from gateway.tool_stream import CallArguments, CallStart, ToolStream
from strata.v1 import common_pb2

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from starlette.requests import Request
    from starlette.types import Send

    from gateway.request_values import Chunk, Incoming
    from gateway.tool_stream import Piece
    from strata.v1 import gateway_pb2

VERSION_HEADER = "anthropic-version"


def stop_reason(final: gateway_pb2.GenerateResponse) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a finished request."""
    if answered_with_calls(final):
        return "tool_use", None
    if final.finish_reason == common_pb2.FINISH_REASON_LENGTH:
        return "max_tokens", None
    if final.stop_sequence:
        return "stop_sequence", final.stop_sequence
    return "end_turn", None


def usage(final: gateway_pb2.GenerateResponse) -> dict[str, int]:
    """Anthropic's usage: the prompt tokens computed, those the prefix cache served, the output."""
    counts = final.usage
    return {
        "input_tokens": counts.input_tokens - counts.cached_input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": counts.cached_input_tokens,
        "output_tokens": counts.output_tokens,
    }


def tool_use(call: common_pb2.ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments_json)}


def message(final: gateway_pb2.GenerateResponse, thinks: bool = False) -> dict[str, Any]:
    """The whole answer as Anthropic's `message` object (a thinking model's reasoning first, as a
    `thinking` block)."""
    reason, sequence = stop_reason(final)
    reasoning, answer = ReasoningSplit.split(final.text, thinks)
    content = [tool_use(call) for call in final.tool_calls] or [{"type": "text", "text": answer}]
    if reasoning:
        content.insert(0, {"type": "thinking", "thinking": reasoning, "signature": ""})
    return {
        "id": f"msg_{final.request_id}",
        "type": "message",
        "role": "assistant",
        "model": final.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(final),
    }


class _Endpoint(Endpoint):
    """What both endpoints share: the version header, the body parsed into the pipeline's Incoming,
    and refusals in Anthropic's shape; `respond` is each one's own."""

    schema: type[MessagesRequest] | type[CountTokensRequest]

    def shape(self, error: HttpError) -> HttpError:
        return anthropic_error(error)

    async def prepare(self, request: Request) -> tuple[Incoming, MessagesRequest | CountTokensRequest]:
        if not request.headers.get(VERSION_HEADER):
            raise HttpError(
                400, f"{VERSION_HEADER}: the header is required, e.g. 2023-06-01", param=VERSION_HEADER
            )
        body, deadline = await self._read(request, self.schema)
        try:
            chat = body.as_chat()
        except ValidationError as error:
            raise from_validation(error) from error
        return self._incoming(chat, request, deadline), body


class Messages(_Endpoint):
    """POST /v1/messages."""

    endpoint = "messages"
    schema = MessagesRequest

    async def respond(
        self, incoming: Incoming, body: MessagesRequest | CountTokensRequest, send: Send
    ) -> JSONResponse | None:
        if isinstance(body, MessagesRequest) and body.stream:
            return await self._stream(incoming, send)
        return await self._whole(incoming)

    async def _whole(self, incoming: Incoming) -> JSONResponse:
        try:
            async with contextlib.aclosing(self._pipeline.run(incoming)) as chunks:
                async for chunk in chunks:
                    if chunk.final is not None:
                        thinks = self._pipeline.thinks(chunk.final.model)
                        return JSONResponse(message(chunk.final, thinks), headers=headers(chunk.final))
        except GatewayError as error:
            return anthropic_error(from_gateway(error)).response()
        raise AssertionError("the pipeline ended without a final chunk")

    async def _stream(self, incoming: Incoming, send: Send) -> JSONResponse | None:
        """Send the stream once its first chunk is there; a JSON error when none came."""
        async with contextlib.aclosing(self._pipeline.run(incoming)) as chunks:
            try:
                first = await anext(chunks)
            except GatewayError as error:
                return anthropic_error(from_gateway(error)).response()
            events = self._events(incoming.request, first, chunks)
            idle = self._settings.stream_idle_timeout_s
            model = first.model or incoming.request.model
            await send_stream(events, send, self.endpoint, idle, lambda: model)
        return None

    async def _events(
        self, request: gateway_pb2.GenerateRequest, first: Chunk, chunks: AsyncGenerator[Chunk, None]
    ) -> AsyncGenerator[bytes, None]:
        head: dict[str, Any] = {
            "id": f"msg_{request.request_id}",
            "type": "message",
            "role": "assistant",
            "model": first.model or request.model or self._settings.default_route,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": first.input_tokens - first.cached_input_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": first.cached_input_tokens,
                "output_tokens": 0,
            },
        }
        yield named_event("message_start", {"type": "message_start", "message": head})
        held = ToolStream(request)
        split = ReasoningSplit(self._pipeline.thinks(first.model or request.model))
        blocks = _Blocks()
        chunk: Chunk | None = first
        try:
            while chunk is not None:
                final = chunk.final
                if final is None:
                    reasoning, answer = split.take(chunk.text)
                    events = blocks.thinking(reasoning) + blocks.events(held.take(answer))
                else:
                    reasoning, answer = split.finish(chunk.text)
                    events = blocks.thinking(reasoning) + blocks.events(held.finish(answer, final))
                    events += blocks.closing(final)
                for kind, payload in events:
                    yield named_event(kind, payload)
                if final is not None:
                    return
                chunk = await anext(chunks, None)
        except GatewayError as error:
            yield named_event("error", anthropic_error(from_gateway(error)).body())


class _Blocks:
    """A stream's content blocks: the text's, and each call's, opened and closed in order."""

    def __init__(self) -> None:
        self._count = 0
        self._thinking: int | None = None
        """The open thinking block's index."""
        self._text: int | None = None
        """The open text block's index."""
        self._calls: dict[int, int] = {}
        """A call's place -> its block's index."""

    def thinking(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        """The events of reasoning: its thinking block opened at the first, a thinking_delta."""
        if not text:
            return []
        out = []
        if self._thinking is None:
            self._thinking = self._count
            out.append(self._start({"type": "thinking", "thinking": "", "signature": ""}))
        delta = {"type": "thinking_delta", "thinking": text}
        out.append(
            ("content_block_delta", {"type": "content_block_delta", "index": self._thinking, "delta": delta})
        )
        return out

    def events(self, pieces: list[Piece]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = self._stop_thinking() if pieces else []
        for piece in pieces:
            if isinstance(piece, str):
                out += self._text_delta(piece)
            elif isinstance(piece, CallStart):
                out += self._stop_text()
                self._calls[piece.index] = self._count
                block = {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
                out.append(self._start(block))
            elif isinstance(piece, CallArguments):
                delta = {"type": "input_json_delta", "partial_json": piece.text}
                index = self._calls[piece.index]
                out.append(
                    ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
                )
            else:
                out.append(
                    ("content_block_stop", {"type": "content_block_stop", "index": self._calls[piece.index]})
                )
        return out

    def closing(self, final: gateway_pb2.GenerateResponse) -> list[tuple[str, dict[str, Any]]]:
        """The events that end a stream: the text block's stop (an answer with no block gets an empty
        text block), message_delta with the stop reason and usage, message_stop."""
        out = self._stop_thinking()
        if self._text is None and not self._calls:
            out += self._text_delta("")  # an answer with no text and no call still has its text block
        out += self._stop_text()
        reason, sequence = stop_reason(final)
        ending: dict[str, Any] = {"stop_reason": reason, "stop_sequence": sequence}
        out.append(("message_delta", {"type": "message_delta", "delta": ending, "usage": usage(final)}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def _start(self, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self._count += 1
        return "content_block_start", {
            "type": "content_block_start",
            "index": self._count - 1,
            "content_block": block,
        }

    def _text_delta(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        out = []
        if self._text is None:
            self._text = self._count
            out.append(self._start({"type": "text", "text": ""}))
        if text:
            delta = {"type": "text_delta", "text": text}
            out.append(
                ("content_block_delta", {"type": "content_block_delta", "index": self._text, "delta": delta})
            )
        return out

    def _stop_thinking(self) -> list[tuple[str, dict[str, Any]]]:
        if self._thinking is None:
            return []
        index, self._thinking = self._thinking, None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _stop_text(self) -> list[tuple[str, dict[str, Any]]]:
        if self._text is None:
            return []
        index, self._text = self._text, None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]


class CountTokens(_Endpoint):
    """POST /v1/messages/count_tokens."""

    endpoint = "messages.count_tokens"
    schema = CountTokensRequest

    async def respond(
        self, incoming: Incoming, body: MessagesRequest | CountTokensRequest, send: Send
    ) -> JSONResponse | None:
        try:
            count = await self._pipeline.count_tokens(incoming)
        except GatewayError as error:
            return anthropic_error(from_gateway(error)).response()
        return JSONResponse({"input_tokens": count})
