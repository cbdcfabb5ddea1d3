"""Structured output and tool calls through the whole stack: gRPC's SamplingParams.constraint and tools,
and the official openai SDK's `response_format` and `tools` against the OpenAI-compatible HTTP API.

One real stack per module (tokenizer service, worker, gateway with its HTTP API; the tiny random
model, whose unconstrained text is noise: an answer that parses is the grammar's doing; its 4096-token
context holds the tools' description, which the tiny byte-level tokenizer makes long).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import grpc
import jsonschema
import openai
import pytest

from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.grammar_cases import SCHEMA, WEATHER
from tests.integration.http_harness import KEY, MODEL, HttpStack

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
METADATA = [("authorization", f"Bearer {KEY}")]


@pytest.fixture(scope="module")
def stack(tiny_long_serving_dir: Path) -> Iterator[HttpStack]:
    with HttpStack(tiny_long_serving_dir, step_delay_s=0.0) as running:
        yield running


def client(stack: HttpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60)


def grpc_generate(stack: HttpStack, request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateResponse:
    with grpc.insecure_channel(stack.gateway_address) as channel:
        reply: gateway_pb2.GenerateResponse = gateway_pb2_grpc.GatewayStub(channel).Generate(
            request, metadata=METADATA, timeout=60
        )
        return reply


def _chat(max_new_tokens: int = 96, **fields: Any) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content="Say something")],
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens),
        **fields,
    )


def _choice(mode: gateway_pb2.ToolChoiceMode.ValueType, name: str = "") -> gateway_pb2.ToolChoice:
    return gateway_pb2.ToolChoice(mode=mode, name=name)  # type: ignore[arg-type]


def test_grpc_constraints_hold_their_language(stack: HttpStack) -> None:
    forms = {
        "json_schema": (common_pb2.OutputConstraint(json_schema=json.dumps(SCHEMA)), None),
        "regex": (common_pb2.OutputConstraint(regex="[A-Z]{2}-[0-9]{3}"), r"[A-Z]{2}-[0-9]{3}"),
        "lark": (
            common_pb2.OutputConstraint(lark_grammar='start: "red" | "green" | "blue"'),
            "red|green|blue",
        ),
    }
    free = grpc_generate(stack, _chat(24)).text
    for name, (constraint, pattern) in forms.items():
        request = _chat()
        request.sampling.constraint.CopyFrom(constraint)
        reply = grpc_generate(stack, request)
        assert reply.finish_reason == common_pb2.FINISH_REASON_STOP, (name, reply.text)
        if pattern is None:
            jsonschema.validate(json.loads(reply.text), SCHEMA)
        else:
            assert re.fullmatch(pattern, reply.text), (name, reply.text)
        assert reply.text != free


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (common_pb2.OutputConstraint(), "sampling.constraint"),
        (common_pb2.OutputConstraint(json_schema="{nope"), "sampling.constraint.json_schema"),
        (
            common_pb2.OutputConstraint(json_schema='{"type": "object", "if": {}}'),
            "sampling.constraint.json_schema",
        ),
        (common_pb2.OutputConstraint(lark_grammar="start: nothing_here"), "sampling.constraint.lark_grammar"),
    ],
)
def test_grpc_bad_constraints_are_invalid_argument_naming_the_field(
    stack: HttpStack, constraint: common_pb2.OutputConstraint, field: str
) -> None:
    request = _chat()
    request.sampling.constraint.CopyFrom(constraint)
    with pytest.raises(grpc.RpcError) as caught:
        grpc_generate(stack, request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (caught.value.details() or "")


def test_grpc_tool_choices(stack: HttpStack) -> None:
    tools = [
        gateway_pb2.Tool(name=name, description=name, parameters_json=json.dumps(schema))
        for name, schema in SCHEMAS.items()
    ]
    required = grpc_generate(
        stack,
        _chat(tools=tools, tool_choice=_choice(gateway_pb2.TOOL_CHOICE_MODE_REQUIRED)),
    )
    assert required.tool_calls, required.text
    for call in required.tool_calls:  # the grammar allows one call or several
        jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])
    named = grpc_generate(
        stack,
        _chat(
            tools=tools,
            tool_choice=_choice(gateway_pb2.TOOL_CHOICE_MODE_NAMED, "get_time"),
        ),
    )
    assert [c.name for c in named.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(named.tool_calls[0].arguments_json), TIME)
    none = grpc_generate(
        stack,
        _chat(24, tools=tools, tool_choice=_choice(gateway_pb2.TOOL_CHOICE_MODE_NONE)),
    )
    assert not none.tool_calls and none.text == grpc_generate(stack, _chat(24)).text
    auto = grpc_generate(stack, _chat(tools=tools))
    if auto.tool_calls:
        assert auto.text.startswith("<tool_call>") and auto.text.endswith("</tool_call>")
        jsonschema.validate(json.loads(auto.tool_calls[0].arguments_json), SCHEMAS[auto.tool_calls[0].name])
    else:
        assert not auto.text.startswith("<"), auto.text
    with pytest.raises(grpc.RpcError) as caught:
        grpc_generate(
            stack,
            _chat(
                tools=tools,
                tool_choice=_choice(gateway_pb2.TOOL_CHOICE_MODE_NAMED, "x"),
            ),
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tool_choice.name" in str(
        caught.value.details()
    )


def test_sdk_response_format_json_schema_json_object_and_regex(stack: HttpStack) -> None:
    sdk = client(stack)
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=96,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)
    loose = sdk.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, response_format={"type": "json_object"}
    )
    assert (loose.choices[0].message.content or "").startswith("{")
    regex = sdk.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=24,
        temperature=0,
        extra_body={"response_format": {"type": "regex", "regex": "(yes|no), [0-9]{2}"}},
    )
    assert re.fullmatch("(yes|no), [0-9]{2}", regex.choices[0].message.content or "")
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}},
        )
    assert "sampling.constraint.json_schema" in str(caught.value) and "Unimplemented" in str(caught.value)


def test_sdk_tool_calls_whole_and_streamed(stack: HttpStack) -> None:
    sdk = client(stack)
    one = sdk.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    choice = one.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])  # type: ignore[union-attr]
    # Several calls are allowed by default: the random model writes calls until it stops or its
    # token limit cuts one (dropped; finish reason length); every whole one follows its schema.
    reply = sdk.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0
    )
    several = reply.choices[0]
    assert several.finish_reason in ("tool_calls", "length") and several.message.content is None
    made = several.message.tool_calls or []
    assert made and len({c.id for c in made}) == len(made)
    for each in made:
        assert each.type == "function" and each.id.startswith("call_")
        jsonschema.validate(json.loads(each.function.arguments), SCHEMAS[each.function.name])  # type: ignore[union-attr]

    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=96,
        temperature=0,
        stream=True,
    )
    names, fragments, content, finish = [], [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            assert part.index == 0 and part.function is not None
            if part.function.name is not None:  # the call's first chunk: its id and name
                names.append(part.function.name)
                assert part.id is not None and part.id.startswith("call_")
            fragments.append(part.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls" and content == ""
    assert len([f for f in fragments if f]) > 1, "the arguments come in fragments as they are written"
    jsonschema.validate(json.loads("".join(fragments)), WEATHER)

    # The conversation goes on: the call and the tool's answer are sent back, and accepted.
    follow_up: list[ChatCompletionMessageParam] = [
        *CHAT,
        {"role": "assistant", "tool_calls": [call.model_dump()]},  # type: ignore[list-item]
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    after = sdk.chat.completions.create(
        model=MODEL, messages=follow_up, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert after.choices[0].message.tool_calls is None
