"""The gateway's structured-output checks and tool calls, alone: what prepare makes of a request's tools
(the prompt and the grammar), what parse makes of an answer, which bad inputs are refused naming the
field, how a stream holds a call back, and the client's constraint keywords.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway import tool_calls
from gateway.errors import InvalidArgument
from gateway.settings import GatewaySettings
from gateway.tool_stream import CallArguments, CallEnd, CallStart, Piece, ToolStream
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


def _call_json(grammar: str) -> dict[str, object]:
    """The JSON schema of a call, as the grammar holds it."""
    line = next(line for line in grammar.splitlines() if line.startswith("call: %json "))
    return dict(json.loads(line.removeprefix("call: %json ")))


def test_required_and_named_constrain_to_calls_and_leave_the_conversation_alone() -> None:
    """The grammar holds the answer to calls; the conversation is the client's (the tokenizer service
    shows the model the tools: tests/unit/test_tool_prompt.py)."""
    required = tool_calls.prepare(_request(Mode.TOOL_CHOICE_MODE_REQUIRED))
    grammar = required.sampling.constraint.lark_grammar
    assert grammar.startswith(
        'start: block ("\\n" block)*\nblock: "<tool_call>" "\\n"? call "\\n"? "</tool_call>"'
    )
    schema = _call_json(grammar)
    assert [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["get_weather", "get_time"]  # type: ignore[attr-defined]
    assert schema["anyOf"][0]["properties"]["arguments"] == ARGS  # type: ignore[index]
    assert [m.content for m in required.messages] == ["Weather in Paris?"]
    named = tool_calls.prepare(_request(Mode.TOOL_CHOICE_MODE_NAMED, "get_time"))
    assert named.sampling.constraint.lark_grammar.startswith("start: block\n"), "one call of that function"
    assert _call_json(named.sampling.constraint.lark_grammar)["properties"]["name"] == {"const": "get_time"}  # type: ignore[index]


def test_auto_allows_text_or_calls_and_none_changes_nothing() -> None:
    auto = tool_calls.prepare(_request())
    grammar = auto.sampling.constraint.lark_grammar
    assert grammar.startswith('start: TEXT | block ("\\n" block)*') and "%json" in grammar
    none = _request(Mode.TOOL_CHOICE_MODE_NONE)
    assert tool_calls.prepare(none) is none


def test_single_call_allows_one_call_only() -> None:
    """parallel_tool_calls false (OpenAI), disable_parallel_tool_use (Anthropic): one block, for
    required and for auto."""
    required = _request(Mode.TOOL_CHOICE_MODE_REQUIRED)
    required.tool_choice.single_call = True
    one = tool_calls.prepare(required)
    assert one.sampling.constraint.lark_grammar.startswith("start: block\n")
    auto = _request()
    auto.tool_choice.single_call = True
    assert tool_calls.prepare(auto).sampling.constraint.lark_grammar.startswith("start: TEXT | block\n")


WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa\\"ris}"}}</tool_call>'
TIME_CALL = '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'


def test_parse_reads_every_call_as_written_and_drops_text_and_cut_calls() -> None:
    request = _request(Mode.TOOL_CHOICE_MODE_REQUIRED)
    first, second = tool_calls.parse(request, f"{WEATHER_CALL}\n{TIME_CALL}\n", "r1")
    assert (first.name, second.name) == ("get_weather", "get_time")
    assert first.arguments_json == '{"city": "Pa\\"ris}"}', "the arguments as the model wrote them"
    assert json.loads(first.arguments_json) == {"city": 'Pa"ris}'} and second.arguments_json == "{}"
    assert (first.id, second.id) == (tool_calls.call_id("r1", 0), tool_calls.call_id("r1", 1))
    assert first.id.startswith("call_") and len(first.id) == 29 and first.id != second.id
    assert tool_calls.call_id("r2", 0) != first.id, "another request's calls have other ids"
    (kept,) = tool_calls.parse(request, f'{WEATHER_CALL}\n<tool_call>{{"name": "get_time", "argu', "r1")
    assert kept == first, "a call the token limit cut is dropped, the whole ones before it kept"
    assert tool_calls.parse(request, '<tool_call>{"name": "get_time", "argu', "r1") == []
    auto = _request()
    assert tool_calls.parse(auto, "It is sunny.", "r1") == []
    (wrapped,) = tool_calls.parse(auto, TIME_CALL, "r1")
    assert wrapped.name == "get_time"
    assert tool_calls.parse(_request(Mode.TOOL_CHOICE_MODE_NONE), TIME_CALL, "r1") == []
    # Arguments that are not a JSON object make no call: every API hands a call's arguments on as one.
    assert tool_calls.parse(auto, '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', "r1") == []


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
    ("turn", "message"),
    [
        (common_pb2.ChatMessage(role="tool", content="21 C"), "messages[1].tool_call_id: a tool turn names"),
        (
            common_pb2.ChatMessage(
                role="user", content="x", tool_calls=[common_pb2.ToolCall(id="c", name="f")]
            ),
            "messages[1].tool_calls: only an assistant turn",
        ),
        (common_pb2.ChatMessage(role="assistant"), "messages[1].content: must not be empty"),
        (common_pb2.ChatMessage(role="robot", content="x"), "messages[1].role: 'robot'"),
    ],
)
def test_the_gateway_checks_tool_turns(turn: common_pb2.ChatMessage, message: str) -> None:
    """A tool turn names its call, only the assistant calls, a turn without calls has content; an
    assistant turn with calls and no text, and a tool turn with its call's id, pass."""
    first = common_pb2.ChatMessage(role="user", content="Weather?")
    with pytest.raises(InvalidArgument) as caught:
        validate(gateway_pb2.GenerateRequest(messages=[first, turn]), SETTINGS, lambda _: None, {})
    assert str(caught.value).startswith(message)
    calls = common_pb2.ChatMessage(role="assistant", tool_calls=[common_pb2.ToolCall(id="c", name="f")])
    answer = common_pb2.ChatMessage(role="tool", content="21 C", tool_call_id="c")
    validate(gateway_pb2.GenerateRequest(messages=[first, calls, answer]), SETTINGS, lambda _: None, {})


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
        validate(request, SETTINGS, lambda _: None, {})
    assert str(caught.value).startswith(message)


def _streamed(stream: ToolStream, parts: list[str], final: gateway_pb2.GenerateResponse) -> list[Piece]:
    pieces: list[Piece] = []
    for part in parts:
        pieces += stream.take(part)
    return pieces + stream.finish("", final)


def test_a_stream_announces_each_call_and_sends_its_arguments_as_written() -> None:
    """Calls written a few characters at a time: each announced once its name is complete, its
    arguments in fragments that join to what the final answer parses, ended when the call closes."""
    text = f"{WEATHER_CALL}\n{TIME_CALL}"
    request = _request(Mode.TOOL_CHOICE_MODE_REQUIRED, more=())
    request.request_id = "r1"
    final = gateway_pb2.GenerateResponse(tool_calls=tool_calls.parse(request, text, "r1"))
    parts = [text[i : i + 5] for i in range(0, len(text), 5)]
    pieces = _streamed(ToolStream(request), parts, final)
    starts = [p for p in pieces if isinstance(p, CallStart)]
    assert [(p.index, p.id, p.name) for p in starts] == [
        (0, final.tool_calls[0].id, "get_weather"),
        (1, final.tool_calls[1].id, "get_time"),
    ]
    for index, call in enumerate(final.tool_calls):
        fragments = [p.text for p in pieces if isinstance(p, CallArguments) and p.index == index]
        assert len(fragments) > (1 if index == 0 else 0) and "".join(fragments) == call.arguments_json
        (end,) = [p for p in pieces if isinstance(p, CallEnd) and p.index == index]
        assert end.arguments == call.arguments_json
    assert not any(isinstance(p, str) for p in pieces), "no call text leaks out as content"
    assert pieces.index(starts[1]) > next(i for i, p in enumerate(pieces) if isinstance(p, CallEnd))


def test_a_stream_lets_text_through_and_a_cut_call_becomes_text() -> None:
    auto = ToolStream(_request())
    assert auto.take(" ") == [] and auto.take("It") == [" It"] and auto.take(" is") == [" is"]
    cut = ToolStream(_request())
    assert cut.take("<tool") == [] and cut.finish("_call", gateway_pb2.GenerateResponse()) == ["<tool_call"]
    assert ToolStream(gateway_pb2.GenerateRequest(prompt="x")).take("a") == ["a"]
    announced = ToolStream(_request())
    assert [type(p) for p in announced.take('<tool_call>{"name": "get_time", "arguments": {"a')] == [
        CallStart,
        CallArguments,
    ]
    assert announced.finish("", gateway_pb2.GenerateResponse()) == [CallEnd(0, '{"a')], (
        "an announced call is ended"
    )


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


QWEN = Path(__file__).resolve().parents[2] / "models" / "Qwen2.5-Coder-0.5B-Instruct"


def test_tags_that_are_tokens_are_named_as_tokens() -> None:
    """A tokenizer whose call tags are tokens of their own (Qwen2.5's) gets a grammar that names them
    as llguidance names special tokens; one without gets them as text."""
    tokens = tool_calls.prepare(_request(Mode.TOOL_CHOICE_MODE_REQUIRED), tag_tokens=True)
    assert '\nblock: <tool_call> "\\n"? call "\\n"? </tool_call>\n' in tokens.sampling.constraint.lark_grammar
    text = tool_calls.prepare(_request(Mode.TOOL_CHOICE_MODE_REQUIRED))
    assert (
        '\nblock: "<tool_call>" "\\n"? call "\\n"? "</tool_call>"\n' in text.sampling.constraint.lark_grammar
    )


@pytest.mark.skipif(not (QWEN / "tokenizer.json").exists(), reason="Qwen2.5-Coder-0.5B is not fetched")
def test_qwens_tokenizer_has_the_tags_as_tokens_and_its_grammar_takes_them() -> None:
    import llguidance

    from services.tokenizer.registry import load_model

    assert load_model("qwen", QWEN).tool_call_tokens
    tokenizer = llguidance.LLTokenizer((QWEN / "tokenizer.json").read_text())
    grammar = tool_calls.prepare(_request(Mode.TOOL_CHOICE_MODE_REQUIRED), tag_tokens=True)
    matcher = llguidance.LLMatcher(
        tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar.sampling.constraint.lark_grammar)
    )
    assert matcher.validate_tokens([tokenizer.tokenize_str("<tool_call>")[0]]) == 1, matcher.get_error()


def test_a_thinking_model_may_reason_before_its_calls(tmp_path: Path) -> None:
    """With the think tags as tokens (tests/tiny_tokenizer.py's THINK_TOKENS) the grammar lets an
    answer open with reasoning, then its calls (required) or text or calls (auto), and the parse
    reads the calls after the reasoning."""
    import llguidance
    from tokenizers import Tokenizer

    from tests.tiny_tokenizer import THINK_TOKENS, write_tiny_tokenizer

    source = (write_tiny_tokenizer(tmp_path, added=THINK_TOKENS) / "tokenizer.json").read_text()
    tokenizer, encoder = llguidance.LLTokenizer(source), Tokenizer.from_str(source)
    thought = (
        '<think>I should look it up.</think>\n\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    cases = [
        (Mode.TOOL_CHOICE_MODE_REQUIRED, thought, True),
        (Mode.TOOL_CHOICE_MODE_REQUIRED, "<think></think>\n\nIt is sunny.", False),
        (Mode.TOOL_CHOICE_MODE_AUTO, "<think>Easy.</think>\n\nIt is sunny.", True),
        (Mode.TOOL_CHOICE_MODE_AUTO, thought, True),
    ]
    for mode, text, allowed in cases:
        grammar = tool_calls.prepare(_request(mode), thinks=True).sampling.constraint.lark_grammar
        matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
        ids = encoder.encode(text, add_special_tokens=False).ids
        assert (matcher.validate_tokens(ids) == len(ids)) is allowed, (mode, text, matcher.get_error())
    (call,) = tool_calls.parse(_request(Mode.TOOL_CHOICE_MODE_REQUIRED), thought, "r1")
    assert call.name == "get_time" and call.arguments_json == "{}"
    assert "think" not in tool_calls.prepare(_request()).sampling.constraint.lark_grammar, "off by default"
