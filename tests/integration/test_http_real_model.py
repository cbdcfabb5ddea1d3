"""The HTTP API on the real default model (SmolLM2-135M-Instruct): the official openai SDK asks the
question the quickstart asks, streamed and not, and gets the answer a person expects."""

from __future__ import annotations

from typing import TYPE_CHECKING

import openai
import pytest

from tests.integration.http_harness import KEY, start_http_stack

if TYPE_CHECKING:
    from pathlib import Path

    from openai.types.chat import ChatCompletionMessageParam

MODEL = "smollm2-135m-instruct"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.real_model
def test_sdk_gets_paris_from_the_real_model(real_model_dir: Path) -> None:
    """Greedy chat through the SDK, whole and streamed: both say Paris, and the stream's text is the
    whole answer's (the chat template, tokenization and detokenization are the real ones)."""
    stack = start_http_stack(real_model_dir, model=MODEL, step_delay_s=0.0)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=120)
        whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0)
        text = whole.choices[0].message.content or ""
        assert "Paris" in text and whole.model == MODEL
        stream = client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=32, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text
    finally:
        stack.close()
