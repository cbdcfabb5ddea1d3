"""Tools through a chat template that has a tool format of its own, end to end: the official openai SDK
against a real stack whose tiny model's template renders tools as Qwen2.5's does
(tests/tiny_tokenizer.py's TOOLS_CHAT_TEMPLATE).

The prompt the worker ran is the template's own rendering of the tools and of the earlier call and
its answer, not Strata's wording: its token count (the response's usage) equals the tokens of the
template's text, rendered here apart, and differs from the wording's. The model's calls, written as
the template's format allows (the JSON on a line of its own or not), parse and follow their schema.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from services.tokenizer.chat import ChatTemplate
from services.tokenizer.tool_prompt import conversation
from strata.v1 import common_pb2, gateway_pb2
from tests.conftest import build_long_serving_dir
from tests.grammar_cases import WEATHER
from tests.integration.http_harness import KEY, MODEL, HttpStack
from tests.tiny_tokenizer import TOOLS_CHAT_TEMPLATE

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

QUESTION = "What is the weather in Paris?"
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CONVERSATION: Any = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_long_serving_dir(
        tmp_path_factory.mktemp("tiny-tools-template"), chat_template=TOOLS_CHAT_TEMPLATE
    )


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Iterator[HttpStack]:
    with HttpStack(model_dir, step_delay_s=0.0) as running:
        yield running


def _prompt_tokens(model_dir: Path, template_tools: bool) -> int:
    """The conversation's prompt tokens as the template renders it (`template_tools`) or with
    Strata's wording."""
    tool = gateway_pb2.Tool(name="get_weather", description="Weather", parameters_json=json.dumps(WEATHER))
    messages = [
        common_pb2.ChatMessage(role="user", content=QUESTION),
        common_pb2.ChatMessage(
            role="assistant",
            tool_calls=[
                common_pb2.ToolCall(id="call_1", name="get_weather", arguments_json='{"city": "Paris"}')
            ],
        ),
        common_pb2.ChatMessage(role="tool", content='{"temperature": 21}', tool_call_id="call_1"),
    ]
    choice = gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_REQUIRED, single_call=True)
    template = ChatTemplate(TOOLS_CHAT_TEMPLATE, MODEL, {})
    turns, tools = conversation(messages, [tool], choice, template_tools)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return len(tokenizer.encode(template.render(turns, tools), add_special_tokens=False).ids)


def test_the_template_renders_the_tools_and_the_earlier_turns(stack: HttpStack, model_dir: Path) -> None:
    sdk = openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60)
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=CONVERSATION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == _prompt_tokens(model_dir, template_tools=True)
    assert reply.usage.prompt_tokens != _prompt_tokens(model_dir, template_tools=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)  # type: ignore[union-attr]
