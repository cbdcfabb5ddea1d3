"""Tool calls: the grammar that holds an answer to its calls, and the parse of the calls it made.

`prepare` checks a chat request's tools and tool_choice and returns the request the pipeline runs,
with a grammar that makes the answer one or more calls, one a line, each written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (REQUIRED; NAMED: one call of that
function; `single_call`: one call), or either text or such calls (AUTO); a block may hold its JSON on
a line of its own, as templates with a tool format of their own (Qwen2.5's) write it; a thinking
model's reasoning may come first (gateway/reasoning.py). Each arguments object is held to its
function's parameters schema by the same grammar. The tokenizer service shows the model the tools
(services/tokenizer/tool_prompt.py). NONE (and a request without tools) runs unchanged. `parse`
turns the final text back into ToolCalls, each keeping its arguments as the model wrote them (a call
the token limit cut is dropped); a call's id follows from the request id and the call's place
(`call_id`), so a stream that announces a call before the answer ends names it as the final answer
does. Errors are InvalidArgument naming the field. This module must not do I/O nor know a
protocol's shapes.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from gateway.errors import InvalidArgument
from gateway.reasoning import CLOSE, OPEN
from strata.v1 import common_pb2, gateway_pb2

MAX_TOOLS = 32
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_HEAD = re.compile(
    r'\s*<tool_call>\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)'
)
"""A call up to its arguments' first character (which must have come: a stream reads it whole)."""
CALL_TAIL = re.compile(r"\s*\}\s*</tool_call>")
Mode = gateway_pb2.ToolChoiceMode
COMPACT_JSON = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
"""llguidance's JSON options for a call, as the worker's json_schema constraint has them: compact JSON
leaves no room for a run of newlines that would spend the token limit inside a valid call."""


def call_id(request_id: str, index: int) -> str:
    """The id of a request's `index`th call: the same wherever it is computed."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


def value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array at `text[start]` ends (one past its closing bracket); None
    while it is unfinished. The grammar has made it valid JSON: only strings and brackets count."""
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(text)):
        char = text[index]
        if escaped:
            escaped = False
        elif in_string:
            escaped = char == "\\"
            in_string = char != '"'
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def mode_of(request: gateway_pb2.GenerateRequest) -> gateway_pb2.ToolChoiceMode.ValueType:
    """The request's effective tool choice: unset is AUTO with tools, NONE without."""
    mode = request.tool_choice.mode
    if mode == Mode.TOOL_CHOICE_MODE_UNSPECIFIED:
        return Mode.TOOL_CHOICE_MODE_AUTO if request.tools else Mode.TOOL_CHOICE_MODE_NONE
    return mode


def calls_tools(request: gateway_pb2.GenerateRequest) -> bool:
    """Whether the answer may be a tool call (the request has tools and the choice is not NONE)."""
    return bool(request.tools) and mode_of(request) != Mode.TOOL_CHOICE_MODE_NONE


def prepare(
    request: gateway_pb2.GenerateRequest, tag_tokens: bool = False, thinks: bool = False
) -> gateway_pb2.GenerateRequest:
    """The request to run for `request`'s tools (itself when it calls none); raises InvalidArgument.
    `tag_tokens`: the model's tokenizer has the call tags as tokens of their own, which the grammar
    must then name as such (a model writes the token, never the text's letters); `thinks`: it has
    the think tags so, and the answer may open with its reasoning (gateway/reasoning.py)."""
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
    single = mode == Mode.TOOL_CHOICE_MODE_NAMED or request.tool_choice.single_call
    prepared.sampling.constraint.lark_grammar = _grammar(call, mode, single, tag_tokens, thinks)
    return prepared


def parse(request: gateway_pb2.GenerateRequest, text: str, request_id: str) -> list[common_pb2.ToolCall]:
    """The calls in a finished answer to `request`, up to one the token limit cut (which is dropped:
    the answer's finish reason says it was cut); [] for text, which cannot start with a call."""
    if not calls_tools(request):
        return []
    calls: list[common_pb2.ToolCall] = []
    # A thinking model's reasoning comes first (the grammar allows it nowhere else).
    opened = text.lstrip()
    position = text.index(CLOSE) + len(CLOSE) if opened.startswith(OPEN) and CLOSE in text else 0
    while (call := _one_call(text, position)) is not None:
        name, arguments, position = call
        calls.append(
            common_pb2.ToolCall(id=call_id(request_id, len(calls)), name=name, arguments_json=arguments)
        )
    return calls


def answered_with_calls(final: gateway_pb2.GenerateResponse) -> bool:
    """Whether the answer is calls that ended as the model chose (the token limit cut none of it)."""
    return bool(final.tool_calls) and final.finish_reason != common_pb2.FINISH_REASON_LENGTH


def _one_call(text: str, start: int) -> tuple[str, str, int] | None:
    """The call written at `text[start:]`: its name, its arguments as written, where it ends."""
    head = CALL_HEAD.match(text, start)
    if head is None:
        return None
    end = value_end(text, head.end())
    tail = CALL_TAIL.match(text, end) if end is not None else None
    if end is None or tail is None:
        return None
    arguments = text[head.end() : end]
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    # A call's arguments are a JSON object (every API hands them on as one); anything else is text.
    if not isinstance(value, dict):
        return None
    return head.group(1), arguments, tail.end()


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


def _grammar(call: dict[str, Any], mode: int, single: bool, tag_tokens: bool, thinks: bool) -> str:
    """The answer's grammar: calls one a line (`single`: one call), or for AUTO text instead, after a
    thinking model's reasoning. Text may not start with '<', so an answer that starts a call must
    finish it as the schema says."""
    calls = "block" if single else 'block ("\\n" block)*'
    start = f"TEXT | {calls}" if mode == Mode.TOOL_CHOICE_MODE_AUTO else calls
    # The think tags are tokens of their own (or the model does not think): a thought's text never
    # holds them, so THOUGHT ends where </think> comes.
    think = f"{OPEN} THOUGHT? {CLOSE} BREAK?\nTHOUGHT: /[\\s\\S]+/\nBREAK: /\\n+/\n" if thinks else ""
    start = f"think? ({start})\nthink: {think}" if thinks else start
    # llguidance names a special token <like_this>, and text "like this".
    opening, closing = (CALL_OPEN, CALL_CLOSE) if tag_tokens else (f'"{CALL_OPEN}"', f'"{CALL_CLOSE}"')
    return (
        f"start: {start}\n"
        f'block: {opening} "\\n"? call "\\n"? {closing}\n'
        "TEXT: /[^<][\\s\\S]*/\n"
        f"call: %json {json.dumps({**call, 'x-guidance': COMPACT_JSON})}\n"
    )
