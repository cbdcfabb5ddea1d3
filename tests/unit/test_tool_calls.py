"""The gateway's structured-output checks and tool calls, alone: what prepare makes of a request's tools
(the prompt and the grammar), what parse makes of an answer, which bad inputs are refused naming the
field, how a stream holds a call back, and the client's constraint keywords.
"""

from __future__ import annotations

import json

import pytest

from gateway import tool_calls
from gateway.errors import InvalidArgument
from gateway.openai_tools import ToolStream
from gateway.settings import GatewaySettings
from gateway.validation import validate
from strata.generate_request import build_request
from strata.v1 import common_pb2, gateway_pb2

ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
Mode = gateway_pb2.ToolChoiceMode


def _request(
    mode: gateway_pb2.ToolChoiceMode.ValueType = Mode.TOOL_CHOICE_MODE_UNSPECIFIED,
    name: str = "",
    more: tuple[gateway_pb2.Tool, ...] = (),
) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content="Weather in Paris?")],
        tools=[
            gateway_pb2.Tool(name="get_weather", description="The weather", parameters_json=json.dumps(ARGS)),
            gateway_pb2.Tool(name="get_time"),
            *more,
        ],
        tool_choice=gateway_pb2.ToolChoice(mode=mode, name=name),
    )


def test_required_and_named_constrain_to_a_call_and_describe_the_tools() -> None:
    required = tool_calls.prepare(_request(Mode.TOOL_CHOICE_MODE_REQUIRED))
    schema = json.loads(required.sampling.constraint.json_schema)
    assert [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["get_weather", "get_time"]
    assert schema["anyOf"][0]["properties"]["arguments"] == ARGS
    assert required.messages[0].role == "system" and "get_weather" in required.messages[0].content
    assert required.messages[1].content == "Weather in Paris?"
    named = tool_calls.prepare(_request(Mode.TOOL_CHOICE_MODE_NAMED, "get_time"))
    assert json.loads(named.sampling.constraint.json_schema)["properties"]["name"] == {"const": "get_time"}


def test_auto_allows_text_or_a_call_and_none_changes_nothing() -> None:
    auto = tool_calls.prepare(_request())
    grammar = auto.sampling.constraint.lark_grammar
    assert grammar.startswith('start: TEXT | "<tool_call>" call "</tool_call>"') and "%json" in grammar
    none = _request(Mode.TOOL_CHOICE_MODE_NONE)
    assert tool_calls.prepare(none) is none


def test_parse_reads_calls_and_ignores_text_and_cut_calls() -> None:
    request = _request(Mode.TOOL_CHOICE_MODE_REQUIRED)
    (call,) = tool_calls.parse(request, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert call.name == "get_weather" and json.loads(call.arguments_json) == {"city": "Paris"}
    assert call.id.startswith("call_") and len(call.id) == 29
    assert tool_calls.parse(request, '{"name": "get_weather", "argu') == []
    auto = _request()
    assert tool_calls.parse(auto, "It is sunny.") == []
    (wrapped,) = tool_calls.parse(auto, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert wrapped.name == "get_time"
    assert tool_calls.parse(_request(Mode.TOOL_CHOICE_MODE_NONE), '{"name": "x", "arguments": {}}') == []
    # Arguments that are not a JSON object make no call: both APIs hand a call's arguments on as one.
    assert tool_calls.parse(auto, '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>') == []


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_request(Mode.TOOL_CHOICE_MODE_NAMED, "nope"), "tool_choice.name"),
        (gateway_pb2.GenerateRequest(prompt="x", tools=[gateway_pb2.Tool(name="f")]), "tools"),
        (_request(more=(gateway_pb2.Tool(name="bad name"),)), "tools[2].name"),
        (_request(more=(gateway_pb2.Tool(name="get_time"),)), "tools[2].name"),
        (_request(more=(gateway_pb2.Tool(name="f", parameters_json="[1]"),)), "tools[2].parameters_json"),
        (
            gateway_pb2.GenerateRequest(
                messages=[common_pb2.ChatMessage(role="user", content="x")],
                tool_choice=gateway_pb2.ToolChoice(mode=Mode.TOOL_CHOICE_MODE_REQUIRED),
            ),
            "tool_choice",
        ),
    ],
)
def test_bad_tools_are_refused_naming_the_field(request_: gateway_pb2.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        tool_calls.prepare(request_)
    assert str(caught.value).startswith(f"{field}:")


SETTINGS = GatewaySettings.build(
    {"tokenizer_address": "127.0.0.1:1", "routes": [{"model": "tiny", "workers": ["127.0.0.1:1"]}]}
)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (common_pb2.OutputConstraint(), "sampling.constraint: set one of"),
        (common_pb2.OutputConstraint(json_object=False), "sampling.constraint.json_object: must be true"),
        (common_pb2.OutputConstraint(regex=" "), "sampling.constraint.regex: must not be empty"),
        (common_pb2.OutputConstraint(json_schema="{x"), "sampling.constraint.json_schema: must be JSON"),
        (
            common_pb2.OutputConstraint(json_schema="3"),
            "sampling.constraint.json_schema: must be a JSON Schema",
        ),
        (
            common_pb2.OutputConstraint(lark_grammar="x" * 70_000),
            "sampling.constraint.lark_grammar: 70000 bytes",
        ),
    ],
)
def test_the_gateway_checks_a_constraints_shape(
    constraint: common_pb2.OutputConstraint, message: str
) -> None:
    request = gateway_pb2.GenerateRequest(
        prompt="x", sampling=common_pb2.SamplingParams(constraint=constraint)
    )
    with pytest.raises(InvalidArgument) as caught:
        validate(request, SETTINGS, lambda _: None)
    assert str(caught.value).startswith(message)


def test_a_stream_holds_a_call_back_and_lets_text_through() -> None:
    required = ToolStream(_request(Mode.TOOL_CHOICE_MODE_REQUIRED))
    assert required.take('{"name"') == "" and required.take(": 1}") == ""
    auto = ToolStream(_request())
    assert auto.take(" ") == "" and auto.take("It") == " It" and auto.take(" is") == " is"
    call = ToolStream(_request())
    assert call.take("<tool") == "" and call.rest("_call") == "<tool_call"
    assert ToolStream(gateway_pb2.GenerateRequest(prompt="x")).take("a") == "a"


def test_the_client_sets_one_constraint() -> None:
    request = build_request("x", json_schema={"type": "object"})
    assert json.loads(request.sampling.constraint.json_schema) == {"type": "object"}
    assert build_request("x", regex="[0-9]+").sampling.constraint.regex == "[0-9]+"
    assert build_request("x", json_object=True).sampling.constraint.json_object
    assert not build_request("x").sampling.HasField("constraint")
    with pytest.raises(ValueError, match="at most one output constraint"):
        build_request("x", regex="a", grammar='start: "a"')


def test_the_cli_sends_a_constraint_from_text_or_a_file(tmp_path) -> None:
    from strata.cli import build_parser
    from strata.cli.client_commands import _generate_request

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    args = build_parser().parse_args(["generate", "hi", "--chat", "--json-schema", f"@{schema}"])
    request = _generate_request(args)
    assert request.sampling.constraint.json_schema == '{"type": "object"}'
    args = build_parser().parse_args(["generate", "hi", "--regex", "[0-9]+"])
    assert _generate_request(args).sampling.constraint.regex == "[0-9]+"
    plain = _generate_request(build_parser().parse_args(["generate", "hi"]))
    assert not plain.sampling.HasField("constraint")
