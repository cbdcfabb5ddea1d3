"""The HTTP API's `usage.prompt_tokens_details.cached_tokens`, read by the official openai SDK from a
real stack (conftest.py's http_stack: tokenizer service, worker with its prefix cache, gateway with its
HTTP API, the tiny model): the prompt tokens the worker's prefix cache served, on Chat Completions and
Completions, whole and in the streamed usage chunk, with n > 1 counting the prompt once; per tenant;
none for a request that asks for prompt logprobs.

Each prompt opens with a fresh random id, inside its first KV block, so that no other prompt's blocks
match it: a prompt's first request finds nothing cached, its second the full blocks before its
last token (the engine always computes that one).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import openai
import pytest

from services.worker.engine.config import EngineConfig
from tests.integration.http_harness import KEY, MODEL, TIGHT_KEY, HttpStack

if TYPE_CHECKING:
    from openai.types import CompletionUsage

BLOCK: int = EngineConfig.model_fields["block_size"].default
"""The KV block size of http_stack's worker (the engine's default)."""
MAX_TOKENS = 4
FILLER = "the quick brown fox jumps over the lazy dog " * 6


def fresh_prompt() -> str:
    """A prompt of several blocks whose first block no earlier prompt had."""
    return f"{uuid.uuid4().hex} {FILLER}"


def sdk(http_stack: HttpStack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_stack.base_url, api_key=key, max_retries=0, timeout=60)


def ask(client: openai.OpenAI, chat: bool, prompt: str, stream: bool, n: int = 1) -> CompletionUsage:
    """The usage of one greedy request: the whole answer's, or the stream's usage chunk (the last)."""
    answer: Any
    if chat:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            n=n,
            stream=stream,
            stream_options={"include_usage": True} if stream else openai.omit,
            extra_body={"ignore_eos": True},
        )
    else:
        answer = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            n=n,
            stream=stream,
            stream_options={"include_usage": True} if stream else openai.omit,
            extra_body={"ignore_eos": True},
        )
    if not stream:
        assert answer.usage is not None
        usage: CompletionUsage = answer.usage
        return usage
    chunks = list(answer)
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == []
    last: CompletionUsage = chunks[-1].usage
    return last


def cached(usage: CompletionUsage) -> int:
    """`usage.prompt_tokens_details.cached_tokens`, which must be there and an int."""
    assert usage.prompt_tokens_details is not None, usage
    tokens = usage.prompt_tokens_details.cached_tokens
    assert isinstance(tokens, int), usage
    return tokens


def warm(prompt_tokens: int) -> int:
    """What a repeat of a prompt of `prompt_tokens` finds cached: every full block before its last token."""
    return BLOCK * ((prompt_tokens - 1) // BLOCK)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_repeated_prompt_reports_its_cached_blocks(http_stack: HttpStack, chat: bool, stream: bool) -> None:
    client = sdk(http_stack)
    prompt = fresh_prompt()
    first = ask(client, chat, prompt, stream)
    second = ask(client, chat, prompt, stream)
    assert first.prompt_tokens == second.prompt_tokens >= 3 * BLOCK
    assert cached(first) == 0
    assert cached(second) == warm(second.prompt_tokens) > 0
    assert second.completion_tokens == MAX_TOKENS
    assert second.total_tokens == second.prompt_tokens + MAX_TOKENS


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_samples_count_the_prompt_and_its_cached_tokens_once(
    http_stack: HttpStack, chat: bool, stream: bool
) -> None:
    """With n = 3 the later samples take the first one's blocks, yet the prompt counts once: the first
    request reports nothing cached, its repeat the full blocks, and prompt_tokens is one prompt's."""
    client = sdk(http_stack)
    prompt = fresh_prompt()
    first = ask(client, chat, prompt, stream, n=3)
    second = ask(client, chat, prompt, stream, n=3)
    alone = ask(client, chat, prompt, stream)
    assert first.prompt_tokens == second.prompt_tokens == alone.prompt_tokens
    assert first.completion_tokens == second.completion_tokens == 3 * MAX_TOKENS
    assert cached(first) == 0
    assert cached(second) == cached(alone) == warm(alone.prompt_tokens) > 0


def test_another_tenant_finds_nothing_cached(http_stack: HttpStack) -> None:
    """The cache is the tenant's: the same prompt from another tenant reports 0, then its own blocks."""
    prompt = fresh_prompt()
    assert cached(ask(sdk(http_stack), True, prompt, stream=False)) == 0
    tight = sdk(http_stack, TIGHT_KEY)
    other = ask(tight, True, prompt, stream=False)
    assert cached(other) == 0
    assert cached(ask(tight, True, prompt, stream=False)) == warm(other.prompt_tokens) > 0


def test_a_request_for_prompt_logprobs_computes_its_prompt_and_reports_none_cached(
    http_stack: HttpStack,
) -> None:
    """Prompt logprobs need every prompt position's logits, so such a request never reads the cache."""
    client = sdk(http_stack)
    prompt = fresh_prompt()
    ask(client, False, prompt, stream=False)
    reply = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "prompt_logprobs": 0},
    )
    assert reply.usage is not None and cached(reply.usage) == 0
    assert cached(ask(client, False, prompt, stream=False)) == warm(reply.usage.prompt_tokens) > 0
