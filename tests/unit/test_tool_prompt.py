"""A conversation with tools rendered by the tokenizer: through a template that renders tools in the
model's own format, in Strata's wording through one that does not, and through the real Qwen2.5
template when its files were fetched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.tokenizer.chat import ChatTemplate
from services.tokenizer.errors import InvalidArgument
from services.tokenizer.tool_prompt import conversation
from strata.v1 import common_pb2, gateway_pb2
from tests.tiny_tokenizer import CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE

QWEN = Path(__file__).resolve().parents[2] / "models" / "Qwen2.5-Coder-0.5B-Instruct"
SPECIAL = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [gateway_pb2.Tool(name="get_weather", description="The weather", parameters_json=json.dumps(WEATHER))]
Mode = gateway_pb2.ToolChoiceMode
MESSAGES = [
    common_pb2.ChatMessage(role="user", content="Weather in Paris?"),
    common_pb2.ChatMessage(
        role="assistant",
        tool_calls=[common_pb2.ToolCall(id="call_1", name="get_weather", arguments_json='{"city": "Paris"}')],
    ),
    common_pb2.ChatMessage(role="tool", content="21 C", tool_call_id="call_1"),
]


def _render(
    template: ChatTemplate, mode: gateway_pb2.ToolChoiceMode.ValueType = Mode.TOOL_CHOICE_MODE_AUTO
) -> str:
    turns, tools = conversation(MESSAGES, TOOLS, gateway_pb2.ToolChoice(mode=mode), template.renders_tools)
    return template.render(turns, tools)


def test_a_template_with_tools_gets_them_and_the_calls_in_its_own_format() -> None:
    template = ChatTemplate(TOOLS_CHAT_TEMPLATE, "m", SPECIAL)
    assert template.renders_tools
    text = _render(template)
    assert "# Tools\n<tools>\n" in text and '"name": "get_weather"' in text and '"type": "function"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text
    assert "You can call these tools" not in text, "Strata's wording is for templates without tools"
    none = _render(template, Mode.TOOL_CHOICE_MODE_NONE)
    assert "# Tools" not in none and "<tool_response>\n21 C" in none, "NONE hides the tools, not the turns"


def test_a_template_without_tools_gets_stratas_wording() -> None:
    template = ChatTemplate(CHAT_TEMPLATE, "m", SPECIAL)
    assert not template.renders_tools
    text = _render(template, Mode.TOOL_CHOICE_MODE_REQUIRED)
    assert text.startswith("<|im_start|>system\nYou can call these tools:\n")
    assert "one line per call" in text
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert f"<|im_start|>assistant\n{call}" in text
    assert "<|im_start|>user\n<tool_response>21 C</tool_response>" in text
    one = gateway_pb2.ToolChoice(mode=Mode.TOOL_CHOICE_MODE_AUTO, single_call=True)
    turns, _ = conversation(MESSAGES, TOOLS, one, False)
    assert "one line per call" not in turns[0]["content"] and "plain text" in turns[0]["content"]
    with pytest.raises(InvalidArgument, match=r"messages\[2\]\.role is 'tool'"):
        template.render(
            [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "y"},
                {"role": "tool", "content": "z"},
            ]
        )


@pytest.mark.skipif(not (QWEN / "tokenizer_config.json").exists(), reason="Qwen2.5-Coder-0.5B is not fetched")
def test_qwens_own_template_lists_the_tools_and_writes_the_calls() -> None:
    source = json.loads((QWEN / "tokenizer_config.json").read_text())["chat_template"]
    template = ChatTemplate(source, "qwen", SPECIAL)
    assert template.renders_tools
    text = _render(template)
    assert "# Tools" in text and "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text


def test_the_tiny_tokenizer_has_no_tag_tokens(tiny_serving_dir: Path) -> None:
    from services.tokenizer.registry import load_model

    assert not load_model("tiny", tiny_serving_dir).tool_call_tokens
