"""Tool calls for models whose chat template knows no tools: the prompt, the grammar, the parse.

`prepare` checks a chat request's tools and tool_choice and returns the request the pipeline runs:
the tools described to the model in a system message, and an output constraint that makes the
answer a call (REQUIRED, NAMED) or either text or one call written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (AUTO). The arguments object is held to
the function's parameters schema by the same grammar. NONE (and a request without tools) runs
unchanged, its tools unseen. `parse` turns the final text back into ToolCalls. Errors are
InvalidArgument naming the field. This module must not do I/O nor know a protocol's shapes.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from gateway.errors import InvalidArgument
from strata.v1 import common_pb2, gateway_pb2

MAX_TOOLS = 32
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
Mode = gateway_pb2.ToolChoiceMode


def mode_of(request: gateway_pb2.GenerateRequest) -> gateway_pb2.ToolChoiceMode.ValueType:
    """The request's effective tool choice: unset is AUTO with tools, NONE without."""
    mode = request.tool_choice.mode
    if mode == Mode.TOOL_CHOICE_MODE_UNSPECIFIED:
        return Mode.TOOL_CHOICE_MODE_AUTO if request.tools else Mode.TOOL_CHOICE_MODE_NONE
    return mode


def calls_tools(request: gateway_pb2.GenerateRequest) -> bool:
    """Whether the answer may be a tool call (the request has tools and the choice is not NONE)."""
    return bool(request.tools) and mode_of(request) != Mode.TOOL_CHOICE_MODE_NONE


def prepare(request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
    """The request to run for `request`'s tools (itself when it calls none); raises InvalidArgument."""
    mode = mode_of(request)
    if mode not in Mode.values():
        raise InvalidArgument(f"tool_choice.mode: {mode} is not a ToolChoiceMode value")
    if not request.tools:
        if mode != Mode.TOOL_CHOICE_MODE_NONE:
            raise InvalidArgument(
                f"tool_choice: {Mode.Name(mode)} needs tools; send tools or drop tool_choice"
            )
        return request
    schemas = _check_tools(request)
    if mode == Mode.TOOL_CHOICE_MODE_NONE:
        return request
    if request.sampling.HasField("constraint"):
        raise InvalidArgument("sampling.constraint: cannot be combined with tools; drop one of them")
    names = list(schemas)
    if mode == Mode.TOOL_CHOICE_MODE_NAMED:
        if request.tool_choice.name not in schemas:
            raise InvalidArgument(
                f"tool_choice.name: {request.tool_choice.name!r} is not one of the tools ({', '.join(names)})"
            )
        names = [request.tool_choice.name]
    call = _call_schema({name: schemas[name] for name in names})
    prepared = gateway_pb2.GenerateRequest()
    prepared.CopyFrom(request)
    if mode == Mode.TOOL_CHOICE_MODE_AUTO:
        prepared.sampling.constraint.lark_grammar = _auto_grammar(call)
    else:
        prepared.sampling.constraint.json_schema = json.dumps(call)
    _describe(prepared, mode)
    return prepared


def parse(request: gateway_pb2.GenerateRequest, text: str) -> list[gateway_pb2.ToolCall]:
    """The calls in a finished answer to `request`; [] for text (or a call cut by max_new_tokens)."""
    if not calls_tools(request):
        return []
    body = text.strip()
    if mode_of(request) == Mode.TOOL_CHOICE_MODE_AUTO:
        if not (body.startswith(CALL_OPEN) and body.endswith(CALL_CLOSE)):
            return []
        body = body[len(CALL_OPEN) : -len(CALL_CLOSE)]
    try:
        call = json.loads(body)
    except ValueError:
        return []
    # A call's arguments are a JSON object (both APIs give them as one); anything else is text.
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return []
    if not isinstance(call.get("arguments"), dict):
        return []
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    return [
        gateway_pb2.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=call["name"], arguments_json=arguments)
    ]


def _check_tools(request: gateway_pb2.GenerateRequest) -> dict[str, Any]:
    if not request.messages:
        raise InvalidArgument("tools: need messages (a chat request); a raw prompt cannot call tools")
    if len(request.tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools: {len(request.tools)} tools, at most {MAX_TOOLS} allowed")
    schemas: dict[str, Any] = {}
    for index, tool in enumerate(request.tools):
        if not NAME.match(tool.name):
            raise InvalidArgument(
                f"tools[{index}].name: {tool.name!r} must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'"
            )
        if tool.name in schemas:
            raise InvalidArgument(f"tools[{index}].name: {tool.name!r} is given twice")
        schema: Any = {"type": "object"}
        if tool.parameters_json:
            try:
                schema = json.loads(tool.parameters_json)
            except ValueError as exc:
                raise InvalidArgument(f"tools[{index}].parameters_json: must be JSON text: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidArgument(f"tools[{index}].parameters_json: must be a JSON Schema object")
        schemas[tool.name] = schema
    return schemas


def _call_schema(schemas: dict[str, Any]) -> dict[str, Any]:
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in schemas.items()
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _auto_grammar(call: dict[str, Any]) -> str:
    # Text may not start with '<', so an answer that starts a call must finish it as the schema says.
    return (
        f'start: TEXT | "{CALL_OPEN}" call "{CALL_CLOSE}"\n'
        "TEXT: /[^<][\\s\\S]*/\n"
        f"call: %json {json.dumps(call)}\n"
    )


def _describe(request: gateway_pb2.GenerateRequest, mode: int) -> None:
    """Put the tools in a system message (the first one, or a new one before the conversation)."""
    tools = [
        {
            "name": tool.name,
            "description": tool.description,
            "parameters": json.loads(tool.parameters_json or '{"type": "object"}'),
        }
        for tool in request.tools
    ]
    listing = "\n".join(json.dumps(tool) for tool in tools)
    if mode == Mode.TOOL_CHOICE_MODE_AUTO:
        how = (
            f'To call one, answer with only {CALL_OPEN}{{"name": <tool name>, "arguments": '
            f"<arguments object>}}{CALL_CLOSE}; otherwise answer in plain text."
        )
    else:
        how = 'Answer with only a JSON object {"name": <tool name>, "arguments": <arguments object>}.'
    text = f"You can call these tools:\n{listing}\n{how}"
    messages = request.messages
    if messages and messages[0].role == "system":
        messages[0].content = f"{messages[0].content}\n\n{text}"
        return
    rest = list(messages)
    del messages[:]
    messages.append(common_pb2.ChatMessage(role="system", content=text))
    messages.extend(rest)
