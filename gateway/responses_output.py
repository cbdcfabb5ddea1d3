"""What a Responses API answer looks like: the `response` object, its output items, and the stream of
events that builds it.

`ResponseShape` holds what the answer echoes of the request (instructions, tools, tool_choice,
sampling, text format, metadata, previous_response_id, store) and renders the `response` object at
any status: in_progress for `response.created`, then completed, incomplete (stopped by
max_output_tokens: `incomplete_details.reason`) or failed. A finished answer is one `message` item
holding an `output_text` part, or one `function_call` item per call the model made, after a
thinking model's `reasoning` item (gateway/reasoning.py; streamed as reasoning_text deltas). Usage counts the
prompt's tokens with those the prefix cache served as `input_tokens_details.cached_tokens`.
`ResponseEvents` turns the pipeline's chunks into the API's events in order, each with its
`sequence_number`: response.created, response.in_progress, the message's output_item.added and
content_part.added when its first text comes, output_text.delta as text comes, then output_text.done,
content_part.done and output_item.done; each call's output_item.added as soon as its name is written,
function_call_arguments.delta fragments as its arguments are written (tool_stream.py),
function_call_arguments.done and output_item.done; and response.completed (or response.incomplete).
This module must not do I/O nor decide statuses.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from gateway.openai_schema import AssistantToolCall, CalledFunction, ChatMessage
from gateway.reasoning import ReasoningSplit
from gateway.tool_stream import CallArguments, CallStart
from strata.v1 import common_pb2

if TYPE_CHECKING:
    from gateway.responses_schema import ResponsesRequest
    from gateway.tool_stream import Piece
    from strata.v1 import gateway_pb2


def usage(final: gateway_pb2.GenerateResponse) -> dict[str, Any]:
    counts = final.usage
    return {
        "input_tokens": counts.input_tokens,
        "input_tokens_details": {"cached_tokens": counts.cached_input_tokens},
        "output_tokens": counts.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": counts.input_tokens + counts.output_tokens,
    }


def answer_turn(final: gateway_pb2.GenerateResponse, thinks: bool = False) -> ChatMessage:
    """The answer as the assistant turn a continuation (previous_response_id) reads: its reasoning
    left out, as a chat template leaves out earlier turns' reasoning."""
    calls = [
        AssistantToolCall(
            id=call.id,
            type="function",
            function=CalledFunction(name=call.name, arguments=call.arguments_json),
        )
        for call in final.tool_calls
    ]
    if calls:
        return ChatMessage(role="assistant", content=None, tool_calls=calls)
    return ChatMessage(role="assistant", content=ReasoningSplit.split(final.text, thinks)[1])


def _incomplete(final: gateway_pb2.GenerateResponse) -> bool:
    return final.finish_reason == common_pb2.FINISH_REASON_LENGTH


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": "completed"}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call_id.removeprefix('call_')}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponseShape:
    """The `response` object of one request, at whatever point it has reached."""

    def __init__(self, body: ResponsesRequest, request_id: str, model: str, thinks: bool = False) -> None:
        """`thinks`: the model may open its answer with reasoning (gateway/reasoning.py)."""
        self.id = f"resp_{request_id}"
        self.message_id = f"msg_{request_id}"
        self.reasoning_id = f"rs_{request_id}"
        self.thinks = thinks
        self.model = model
        self._created_at = int(time.time())
        self._echo: dict[str, Any] = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": {"type": "text"}}
            if body.text is None or body.text.format is None
            else {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": "auto"
            if body.tool_choice is None
            else body.tool_choice
            if isinstance(body.tool_choice, str)
            else body.tool_choice.model_dump(),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "top_p": body.top_p,
            "truncation": body.truncation or "disabled",
            "user": body.user,
        }

    def render(
        self,
        status: str,
        output: list[dict[str, Any]] | None = None,
        final: gateway_pb2.GenerateResponse | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self._created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": output or [],
            "usage": usage(final) if final is not None else None,
            **self._echo,
        }

    def finished(self, final: gateway_pb2.GenerateResponse) -> dict[str, Any]:
        """The whole answer: completed, or incomplete when max_output_tokens stopped it."""
        self.model = final.model or self.model
        status = "incomplete" if _incomplete(final) else "completed"
        reasoning, answer = ReasoningSplit.split(final.text, self.thinks)
        output = [reasoning_item(self.reasoning_id, reasoning)] if reasoning else []
        if final.tool_calls:
            output += [call_item(c.id, c.name, c.arguments_json, "completed") for c in final.tool_calls]
        else:
            output.append(message_item(self.message_id, answer, status))
        return self.render(status, output, final)


class ResponseEvents:
    """The stream's events, in order, numbered; text is sent as it comes and calls at the end."""

    def __init__(self, shape: ResponseShape) -> None:
        self._shape = shape
        self._sequence = 0
        self._text: str | None = None
        """The message's text so far; None until its item is open."""
        self._calls: dict[int, dict[str, Any]] = {}
        """Each call's item as streamed so far, by its place."""
        self._reasoning: str | None = None
        """The reasoning so far; None until its item is open."""
        self._first = 0
        """The output index of the message or first call: 1 after a reasoning item (which stays at 0)."""

    def _event(self, kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return kind, payload

    def opening(self) -> list[tuple[str, dict[str, Any]]]:
        started = self._shape.render("in_progress")
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def reasoning(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        """The events of reasoning: its item added at the first, a reasoning_text delta."""
        if not text:
            return []
        events = []
        if self._reasoning is None:
            self._reasoning, self._first = "", 1
            item = {"type": "reasoning", "id": self._shape.reasoning_id, "summary": [], "content": []}
            events.append(self._event("response.output_item.added", output_index=0, item=item))
        self._reasoning += text
        where = {"item_id": self._shape.reasoning_id, "output_index": 0, "content_index": 0}
        events.append(self._event("response.reasoning_text.delta", delta=text, **where))
        return events

    def pieces(self, pieces: list[Piece]) -> list[tuple[str, dict[str, Any]]]:
        """The events of a chunk's pieces: text deltas (opening the message item at the first), each
        call's item as soon as its name is known, its arguments' fragments, its end."""
        events: list[tuple[str, dict[str, Any]]] = self._end_reasoning() if pieces else []
        for piece in pieces:
            if isinstance(piece, str):
                events += self._text_delta(piece)
                continue
            call = self._calls.setdefault(piece.index, {})
            if isinstance(piece, CallStart):
                call.update(call_item(piece.id, piece.name, "", "in_progress"))
                events.append(
                    self._event("response.output_item.added", output_index=piece.index, item=dict(call))
                )
                continue
            where = {"item_id": call["id"], "output_index": self._first + piece.index}
            if isinstance(piece, CallArguments):
                events.append(
                    self._event("response.function_call_arguments.delta", delta=piece.text, **where)
                )
                continue
            call.update(arguments=piece.arguments, status="completed")
            events += [
                self._event("response.function_call_arguments.done", arguments=piece.arguments, **where),
                self._event("response.output_item.done", output_index=where["output_index"], item=dict(call)),
            ]
        return events

    def closing(self, final: gateway_pb2.GenerateResponse) -> list[tuple[str, dict[str, Any]]]:
        """The events that end a finished answer: its message's done events (a call answer's items
        have ended with their calls; one cut inside its first call keeps the items it streamed), then
        the response's."""
        events = self._end_reasoning()
        whole = self._shape.finished(final)
        if self._calls and not final.tool_calls:  # a call announced, then cut: its item as streamed
            streamed = [{**item, "status": "incomplete"} for _, item in sorted(self._calls.items())]
            whole["output"] = whole["output"][: self._first] + streamed
        elif not final.tool_calls:
            if self._text is None:
                events += self._open_message()
            item = whole["output"][-1]
            part = item["content"][0]
            events += [
                self._event("response.output_text.done", text=part["text"], logprobs=[], **self._where()),
                self._event("response.content_part.done", part=part, **self._where()),
                self._event("response.output_item.done", output_index=self._first, item=item),
            ]
        kind = "response.completed" if whole["status"] == "completed" else "response.incomplete"
        events.append(self._event(kind, response=whole))
        return events

    def _text_delta(self, delta: str) -> list[tuple[str, dict[str, Any]]]:
        events = self._open_message() if self._text is None else []
        if delta:
            self._text = (self._text or "") + delta
            events.append(
                self._event("response.output_text.delta", delta=delta, logprobs=[], **self._where())
            )
        return events

    def failed(self, error: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """The events of a failure after the stream began: the error, then the failed response."""
        failure = {"code": error.get("code") or "server_error", "message": error["message"]}
        return [
            self._event("error", param=error.get("param"), **failure),
            self._event("response.failed", response=self._shape.render("failed", error=failure)),
        ]

    def _open_message(self) -> list[tuple[str, dict[str, Any]]]:
        self._text = ""
        item = {
            "type": "message",
            "id": self._shape.message_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", output_index=self._first, item=item),
            self._event("response.content_part.added", part=part, **self._where()),
        ]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._shape.message_id, "output_index": self._first, "content_index": 0}

    def _end_reasoning(self) -> list[tuple[str, dict[str, Any]]]:
        """The reasoning item's done events, once (when the answer or the end comes)."""
        if self._reasoning is None:
            return []
        text, self._reasoning = self._reasoning, None
        where = {"item_id": self._shape.reasoning_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.reasoning_text.done", text=text, **where),
            self._event(
                "response.output_item.done",
                output_index=0,
                item=reasoning_item(self._shape.reasoning_id, text),
            ),
        ]
