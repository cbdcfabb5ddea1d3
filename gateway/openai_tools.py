"""The OpenAI API's structured-output and tool shapes, to and from the pipeline's.

`set_constraint` maps `response_format` onto the sampling's output constraint (json_object,
json_schema, and Strata's regex and grammar); `set_tools` maps `tools` and `tool_choice` onto the
request (gateway/tool_calls.py then does the work; the tokenizer service renders the tools and a
conversation's earlier calls for the model); `tool_calls` renders a response's calls as the API's
objects (a stream's calls are read as they come by tool_stream.py).
This module must not do I/O nor decide anything about a request: the pipeline validates.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from strata.v1 import gateway_pb2

if TYPE_CHECKING:
    from gateway.openai_schema import NamedToolChoice, ResponseFormat, Tool
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
    parallel: bool | None = None,
) -> None:
    """`parallel` False allows one call only (OpenAI's parallel_tool_calls)."""
    for tool in tools or ():
        function = tool.function
        parameters = json.dumps(function.parameters) if function.parameters is not None else ""
        request.tools.add(name=function.name, description=function.description, parameters_json=parameters)
    request.tool_choice.single_call = parallel is False
    if choice is None:
        return
    if isinstance(choice, str):
        request.tool_choice.mode = CHOICES[choice]
    else:
        request.tool_choice.mode = gateway_pb2.TOOL_CHOICE_MODE_NAMED
        request.tool_choice.name = choice.function.name


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
