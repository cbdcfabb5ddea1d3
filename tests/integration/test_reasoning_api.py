"""Reasoning through the whole stack with the official openai and anthropic SDKs: a model whose tokenizer
has `<think>` and `</think>` as tokens of their own (Qwen3's, here the tiny model's tokenizer with the
two added) gets its reasoning apart from the answer, whole and streamed, as Chat's
`reasoning_content`, a Messages `thinking` block and a Responses `reasoning` item; the same text from a
model without those tokens is all answer; with tools, the reasoning may come before the calls.

The tiny random model does not think of itself: Strata's grammar extension to `response_format`
makes it open its answer with a think block (the tokens named as llguidance names them), which is
what a thinking model writes; with tools, the call grammar's optional think block is where the
greedy random model goes, and reasons past the token limit.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import anthropic
import jsonschema
import openai
import pytest

from tests.conftest import build_long_serving_dir
from tests.grammar_cases import WEATHER
from tests.integration.http_harness import KEY, MODEL, HttpStack
from tests.tiny_tokenizer import THINK_TOKENS

if TYPE_CHECKING:
    from collections.abc import Iterator

WORD = "[a-z]{2,8}"
THINKING = {"type": "grammar", "grammar": f'start: <think> /{WORD}/ </think> "\\n\\n" /{WORD}/\n'}
AS_TEXT = {"type": "grammar", "grammar": f'start: "<think>" /{WORD}/ "</think>" "\\n\\n" /{WORD}/\n'}
QUESTION: Any = [{"role": "user", "content": "Where is Paris?"}]


def _stack(tmp_path_factory: pytest.TempPathFactory, added: tuple[str, ...]) -> Iterator[HttpStack]:
    directory = build_long_serving_dir(tmp_path_factory.mktemp("tiny-think"), added=added)
    with HttpStack(directory, step_delay_s=0.0) as running:
        yield running


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpStack]:
    yield from _stack(tmp_path_factory, THINK_TOKENS)


def _ask(stack: HttpStack, response_format: dict[str, str], stream: bool = False) -> Any:
    sdk = openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60)
    return sdk.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=48,
        temperature=0,
        stream=stream,
        extra_body={"response_format": response_format},
    )


def test_a_thinking_models_reasoning_comes_apart_whole_and_streamed(thinking: HttpStack) -> None:
    """The think block's text is `reasoning_content`, the rest `content`, the same whole and streamed;
    a stream sends the reasoning first."""
    whole = _ask(thinking, THINKING).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert re.fullmatch(WORD, reasoning) and re.fullmatch(WORD, whole.content or ""), whole
    streamed: dict[str, str] = {"reasoning_content": "", "content": ""}
    order = []
    for chunk in _ask(thinking, THINKING, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        parts = {
            "reasoning_content": (delta.model_extra or {}).get("reasoning_content"),
            "content": delta.content,
        }
        for key, part in parts.items():
            if part:
                streamed[key] += part
                order.append(key)
    assert streamed == {"reasoning_content": reasoning, "content": whole.content}
    assert order.index("content") > max(i for i, key in enumerate(order) if key == "reasoning_content")


def test_a_model_without_think_tokens_answers_it_all(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same tags written as text by a model whose tokenizer lacks them stay in the answer."""
    for plain in _stack(tmp_path_factory, ()):
        message = _ask(plain, AS_TEXT).choices[0].message
        assert "reasoning_content" not in (message.model_extra or {})
        assert re.fullmatch(f"<think>{WORD}</think>\n\n{WORD}", message.content or ""), message.content


def test_a_thinking_model_may_reason_before_it_calls(thinking: HttpStack) -> None:
    """With tools, the call grammar lets a thinking model open with reasoning, which the worker's
    grammar takes: the answer is a call that follows its schema, or (the random model thinking past
    the token limit, as it does here) reasoning only, reported as reasoning_content with no content
    and no call; never the reasoning's text as content or as a call."""
    sdk = openai.OpenAI(base_url=thinking.base_url, api_key=KEY, max_retries=0, timeout=60)
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    choice = reply.choices[0]
    reasoning = (choice.message.model_extra or {}).get("reasoning_content", "")
    assert "<think>" not in reasoning and "<think>" not in (choice.message.content or "")
    if choice.finish_reason == "tool_calls":
        (call,) = choice.message.tool_calls or []
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)  # type: ignore[union-attr]
    else:
        assert choice.finish_reason == "length" and reasoning and not choice.message.content
        assert not choice.message.tool_calls


def test_the_three_apis_return_the_same_reasoning(thinking: HttpStack) -> None:
    """The same greedy request with tools through Chat Completions, Messages and Responses, whole and
    streamed (the random model reasons past the token limit here): Chat's reasoning_content is the
    Messages thinking block and the Responses reasoning item, and none of them puts it in the answer."""
    tool: Any = {"name": "get_weather", "parameters": WEATHER}
    chat = openai.OpenAI(base_url=thinking.base_url, api_key=KEY, max_retries=0, timeout=60)
    asked = chat.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=[{"type": "function", "function": tool}],
        tool_choice="required",
        max_tokens=32,
        temperature=0,
    ).choices[0]
    reasoning = (asked.message.model_extra or {}).get("reasoning_content", "")
    assert reasoning, asked.message
    claude = anthropic.Anthropic(base_url=thinking.origin, api_key=KEY, max_retries=0, timeout=60)
    claude_tools: Any = [{"name": "get_weather", "input_schema": WEATHER}]
    ask: Any = {"model": MODEL, "max_tokens": 32, "messages": QUESTION, "tools": claude_tools}
    whole = claude.messages.create(**ask, tool_choice={"type": "any"}, extra_body={"temperature": 0})
    first = whole.content[0]
    assert first.type == "thinking" and first.thinking == reasoning
    with claude.messages.stream(**ask, tool_choice={"type": "any"}, extra_body={"temperature": 0}) as stream:
        thoughts = "".join(
            e.delta.thinking
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
        )  # type: ignore[union-attr]
    assert thoughts == reasoning
    request: Any = {
        "model": MODEL,
        "input": QUESTION,
        "tools": [{"type": "function", **tool}],
        "tool_choice": "required",
        "max_output_tokens": 32,
        "temperature": 0,
    }
    item = chat.responses.create(**request).output[0]
    assert item.type == "reasoning" and item.content is not None and item.content[0].text == reasoning
    events = chat.responses.create(**request, stream=True)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    assert deltas == reasoning
