"""The OpenAI API's structured-output and tool shapes, to and from the pipeline's.

`set_constraint` maps `response_format` onto the sampling's output constraint (json_object,
json_schema, and Strata's regex and grammar); `set_tools` maps `tools` and `tool_choice` onto the
request (gateway/tool_calls.py then does the work); `render_turn` writes a conversation's earlier
calls and tool answers as text the chat template can hold, in the same `<tool_call>` format the
model is asked for; `tool_calls` renders a response's calls as the API's objects. `ToolStream` decides,
chunk by chunk, whether a stream's text is content to send now or a call to send whole at the end.
This module must not do I/O nor decide anything about a request: the pipeline validates.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from gateway import tool_calls as calls
from strata.v1 import gateway_pb2

if TYPE_CHECKING:
    from gateway.openai_schema import ChatMessage, NamedToolChoice, ResponseFormat, Tool
    from strata.v1 import common_pb2

CHOICES = {
    "none": gateway_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": gateway_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": gateway_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


def set_constraint(sampling: common_pb2.SamplingParams, response_format: ResponseFormat) -> None:
    kind = response_format.type
    if kind == "json_object":
        sampling.constraint.json_object = True
    elif kind == "json_schema" and response_format.json_schema is not None:
        schema = response_format.json_schema.schema_
        sampling.constraint.json_schema = json.dumps(schema if schema is not None else {"type": "object"})
    elif kind == "regex" and response_format.regex is not None:
        sampling.constraint.regex = response_format.regex
    elif kind == "grammar" and response_format.grammar is not None:
        sampling.constraint.lark_grammar = response_format.grammar


def set_tools(
    request: gateway_pb2.GenerateRequest,
    tools: list[Tool] | None,
    choice: str | NamedToolChoice | None,
) -> None:
    for tool in tools or ():
        function = tool.function
        parameters = json.dumps(function.parameters) if function.parameters is not None else ""
        request.tools.add(name=function.name, description=function.description, parameters_json=parameters)
    if choice is None:
        return
    if isinstance(choice, str):
        request.tool_choice.mode = CHOICES[choice]
    else:
        request.tool_choice.mode = gateway_pb2.TOOL_CHOICE_MODE_NAMED
        request.tool_choice.name = choice.function.name


def render_turn(message: ChatMessage) -> tuple[str, str]:
    """(role, content) of one turn; a tool's answer is a user turn, an earlier call the assistant's."""
    if message.role == "tool":
        return "user", f"<tool_response>{message.text()}</tool_response>"
    if message.role == "assistant" and message.tool_calls:
        written = [
            calls.CALL_OPEN
            + json.dumps({"name": c.function.name, "arguments": _arguments(c.function.arguments)})
            + calls.CALL_CLOSE
            for c in message.tool_calls
        ]
        return "assistant", "\n".join([message.text(), *written]).strip()
    return message.role, message.text()


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # written back as the string the client holds


def tool_calls(final: gateway_pb2.GenerateResponse, *, with_index: bool) -> list[dict[str, Any]]:
    out = []
    for index, call in enumerate(final.tool_calls):
        item: dict[str, Any] = {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json},
        }
        out.append({"index": index, **item} if with_index else item)
    return out


class ToolStream:
    """Whether a chat stream's text goes out as it comes, or waits for the final chunk.

    A request that must call a tool holds all of its text; with tool_choice auto the first character
    decides (an answer in text may not start with '<', a call must).
    """

    def __init__(self, request: gateway_pb2.GenerateRequest) -> None:
        self._mode = calls.mode_of(request) if calls.calls_tools(request) else None
        self._sending = self._mode is None
        self.held = ""
        """Text held back so far: the call's own text, or (auto) the first whitespace."""

    def take(self, text: str) -> str:
        """The part of the text so far to send now; the rest is held."""
        if self._sending:
            return text
        self.held += text
        start = self.held.lstrip()
        if self._mode == gateway_pb2.TOOL_CHOICE_MODE_AUTO and start and not start.startswith("<"):
            self._sending = True
            out, self.held = self.held, ""
            return out
        return ""

    def rest(self, text: str) -> str:
        """The last chunk's text of an answer that made no call: what was held, then `text`."""
        out, self.held = self.held + text, ""
        return out
