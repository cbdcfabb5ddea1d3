"""POST /v1/responses, GET /v1/responses/{id} and DELETE /v1/responses/{id}: OpenAI's Responses API,
through the pipeline.

POST is an ASGI endpoint (http_exchange.py's Endpoint: body limits, the `x-strata-timeout-ms`
deadline, the disconnect watch and the idle-stream timeout, as for Chat Completions). It parses the
body (responses_schema.py), finds the conversation `previous_response_id` continues in the tenant's
store (response_store.py; unknown, expired, evicted, made with `store: false` or another tenant's: 404
`previous_response_not_found`), and maps it through the Chat Completions request it is
(openai_mapping.py), so every front door runs the same pipeline. The answer is the `response` object,
or its stream of events (responses_output.py); a failure before the first event is a JSON error in
OpenAI's shape, one after it an `error` event and `response.failed`. A finished response (completed
or incomplete) with `store` true (the API's default) is kept with the conversation so far; GET returns
it, DELETE forgets it. A pipeline error that names a chat field is answered with the Responses name
(`max_output_tokens`, `text.format`, `input`). This module must not hold request logic (the pipeline
does) nor decide statuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from gateway.errors import GatewayError
from gateway.http_auth import tenant
from gateway.http_exchange import (
    Endpoint,
    named_event,
    send_stream,
)
from gateway.metrics import HTTP_RESPONSES
from gateway.openai_errors import HttpError, from_gateway, from_validation
from gateway.openai_mapping import headers
from gateway.reasoning import ReasoningSplit
from gateway.responses_output import ResponseEvents, ResponseShape, answer_turn
from gateway.responses_schema import ResponsesRequest
from gateway.tool_stream import ToolStream

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from starlette.requests import Request
    from starlette.types import Send

    from gateway.openai_schema import ChatMessage
    from gateway.pipeline import Pipeline
    from gateway.request_values import Chunk, Incoming
    from gateway.response_store import ResponseStore
    from gateway.router import Router
    from gateway.settings import GatewaySettings
    from strata.v1 import gateway_pb2

TOKEN_FIELD = "max_output_tokens"
_PARAMS = {"response_format": "text.format", "messages": "input"}
"""Chat Completions fields a pipeline error may name, as this API names them (a turn's index is not
an item's: instructions and a continuation's history come before the input)."""


def _error(error: GatewayError) -> HttpError:
    answer = from_gateway(error, TOKEN_FIELD)
    head = (answer.param or "").split("[", 1)[0].split(".", 1)[0]
    if head not in _PARAMS:
        return answer
    return dataclasses.replace(answer, param=_PARAMS[head])


def not_found(response_id: str, param: str | None = None) -> HttpError:
    return HttpError(
        404,
        f"{param or 'response'}: {response_id!r} is not a stored response of this tenant (unknown, evicted, "
        "expired, deleted, or made with store: false)",
        param=param,
        code="previous_response_not_found" if param else "response_not_found",
    )


class Responses(Endpoint):
    """POST /v1/responses."""

    endpoint = "responses"

    def __init__(
        self, settings: GatewaySettings, pipeline: Pipeline, router: Router, store: ResponseStore
    ) -> None:
        super().__init__(settings, pipeline, router)
        self._store = store

    async def prepare(self, request: Request) -> tuple[Incoming, tuple[ResponsesRequest, list[ChatMessage]]]:
        """The Incoming, and the body with the conversation its answer continues (for the store)."""
        body, deadline = await self._read(request, ResponsesRequest)
        history: list[ChatMessage] = []
        if body.previous_response_id is not None:
            stored = self._store.get(tenant(request.scope), body.previous_response_id)
            if stored is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            history = list(stored.conversation)
        try:
            chat = body.as_chat(history)
        except ValidationError as error:
            raise from_validation(error) from error
        return self._incoming(chat, request, deadline), (body, [*history, *body.input_turns()])

    async def respond(
        self, incoming: Incoming, body: tuple[ResponsesRequest, list[ChatMessage]], send: Send
    ) -> JSONResponse | None:
        request, conversation = body
        model = incoming.request.model or self._settings.default_route
        shape = ResponseShape(request, incoming.request.request_id, model, self._pipeline.thinks(model))
        if request.stream:
            return await self._stream(incoming, shape, conversation, send)
        try:
            async with contextlib.aclosing(self._pipeline.run(incoming)) as chunks:
                async for chunk in chunks:
                    if chunk.final is not None:
                        whole = shape.finished(chunk.final)
                        self._keep(incoming, whole, conversation, chunk.final)
                        return JSONResponse(whole, headers=headers(chunk.final))
        except GatewayError as error:
            return _error(error).response()
        raise AssertionError("the pipeline ended without a final chunk")

    def _keep(
        self,
        incoming: Incoming,
        whole: dict[str, Any],
        conversation: list[ChatMessage],
        final: gateway_pb2.GenerateResponse,
    ) -> None:
        if whole["store"]:
            thinks = self._pipeline.thinks(final.model)
            self._store.put(incoming.tenant, whole, [*conversation, answer_turn(final, thinks)])

    async def _stream(
        self, incoming: Incoming, shape: ResponseShape, conversation: list[ChatMessage], send: Send
    ) -> JSONResponse | None:
        """Send the stream once its first chunk is there; a JSON error when none came."""
        async with contextlib.aclosing(self._pipeline.run(incoming)) as chunks:
            try:
                first = await anext(chunks)
            except GatewayError as error:
                return _error(error).response()
            shape.model = first.model or shape.model
            events = self._events(incoming, shape, conversation, first, chunks)
            await send_stream(
                events, send, self.endpoint, self._settings.stream_idle_timeout_s, lambda: shape.model
            )
        return None

    async def _events(
        self,
        incoming: Incoming,
        shape: ResponseShape,
        conversation: list[ChatMessage],
        first: Chunk,
        chunks: AsyncGenerator[Chunk, None],
    ) -> AsyncGenerator[bytes, None]:
        built = ResponseEvents(shape)
        for kind, payload in built.opening():
            yield named_event(kind, payload)
        held = ToolStream(incoming.request)
        split = ReasoningSplit(shape.thinks)
        chunk: Chunk | None = first
        try:
            while chunk is not None:
                final = chunk.final
                if final is None:
                    reasoning, answer = split.take(chunk.text)
                    events = built.reasoning(reasoning) + built.pieces(held.take(answer))
                else:
                    reasoning, answer = split.finish(chunk.text)
                    events = built.reasoning(reasoning) + built.pieces(held.finish(answer, final))
                    events += built.closing(final)
                    self._keep(incoming, events[-1][1]["response"], conversation, final)
                for kind, payload in events:
                    yield named_event(kind, payload)
                if final is not None:
                    return
                chunk = await anext(chunks, None)
        except GatewayError as error:
            for kind, payload in built.failed(_error(error).body()["error"]):
                yield named_event(kind, payload)


class StoredResponses:
    """GET and DELETE /v1/responses/{response_id}: the tenant's stored response, or 404."""

    endpoint = "responses.stored"

    def __init__(self, store: ResponseStore) -> None:
        self._store = store

    async def answer(self, request: Request) -> JSONResponse:
        response_id = request.path_params["response_id"]
        owner = tenant(request.scope)
        if request.method == "DELETE":
            found = self._store.delete(owner, response_id)
            answer = (
                JSONResponse({"id": response_id, "object": "response", "deleted": True}) if found else None
            )
        else:
            stored = self._store.get(owner, response_id)
            answer = JSONResponse(stored.body) if stored is not None else None
        if answer is None:
            answer = not_found(response_id).response()
        HTTP_RESPONSES.labels(self.endpoint, str(answer.status_code)).inc()
        return answer
