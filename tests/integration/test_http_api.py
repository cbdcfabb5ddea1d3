"""The OpenAI-compatible HTTP API driven by the clients people use: the official openai SDK (sync and
async) and LiteLLM's OpenAI-compatible provider, against a real stack; and the SDK against the real
default model. (tests/integration/test_http_wire.py checks the wire format itself, with curl.)

One real stack per module (conftest.py's http_stack: tokenizer service, worker, gateway with its HTTP
API on a free port, the tiny random-weight model). Greedy requests (temperature 0) make a stream's
text comparable with the whole answer's.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.integration.http_harness import KEY, MODEL, TIGHT_KEY, HttpStack

if TYPE_CHECKING:
    from pathlib import Path

    from openai.types.chat import ChatCompletionMessageParam

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
STAGES = ("network", "preprocess", "queue", "forward", "decode")
REAL_MODEL = "smollm2-135m-instruct"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


def client(http_stack: HttpStack, key: str = KEY, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_stack.base_url, api_key=key, max_retries=retries, timeout=60)


def test_sdk_chat_completion_has_openai_shape_and_strata_headers(http_stack: HttpStack) -> None:
    """A whole chat completion through the sync SDK: OpenAI's shape, the serving model, the finish
    reason and usage, and the headers that say who served it and where the time went."""
    raw = client(http_stack).chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    reply = raw.parse()
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8 and reply.usage.prompt_tokens > 0
    assert reply.id == f"chatcmpl-{raw.headers['x-request-id']}"
    assert raw.headers["x-strata-fallback-reason"] == ""
    timing = dict(part.strip().split(";dur=") for part in raw.headers["server-timing"].split(","))
    assert set(timing) == {*STAGES, "total"} and float(timing["forward"]) > 0
    assert sum(float(timing[stage]) for stage in STAGES) == pytest.approx(float(timing["total"]), abs=0.05)


def test_sdk_stream_adds_up_to_the_whole_answer_with_usage_last(http_stack: HttpStack) -> None:
    """A greedy stream's deltas add up to the whole answer; with include_usage the last chunk has no
    choices and the usage, and carries the `strata` extension (request id, trace, timing)."""
    sdk = client(http_stack)
    whole = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 12
    assert len({chunk.id for chunk in chunks}) == 1
    extension = (last.model_extra or {})["strata"]
    assert last.id == f"chatcmpl-{extension['request_id']}"
    assert set(extension["timing_ms"]) >= set(STAGES) and extension["server_timing"].startswith(
        "network;dur="
    )


def test_async_sdk_completions_stream_and_not(http_stack: HttpStack) -> None:
    """The async SDK on /v1/completions: a prompt string, stop and seed accepted, a text_completion
    object, and the stream's text equal to the whole one."""

    async def both() -> tuple[Any, list[Any]]:
        sdk = openai.AsyncOpenAI(base_url=http_stack.base_url, api_key=KEY, max_retries=0, timeout=60)
        async with sdk:
            args: dict[str, Any] = {"model": MODEL, "prompt": "Once upon", "max_tokens": 10, "temperature": 0}
            whole = await sdk.completions.create(**args, seed=3, stop=["\n\n"])
            stream = await sdk.completions.create(**args, seed=3, stop=["\n\n"], stream=True)
            return whole, [chunk async for chunk in stream]

    whole, chunks = asyncio.run(both())
    assert whole.object == "text_completion" and whole.model == MODEL and whole.choices[0].text
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_models_list_names_the_routes(http_stack: HttpStack) -> None:
    """GET /v1/models lists every route as an OpenAI model object."""
    models = client(http_stack).models.list()
    assert [model.id for model in models.data] == [MODEL]
    assert models.data[0].object == "model" and models.data[0].owned_by == "strata"


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"extra_body": {"top_k": -1}}, "top_k"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_bad_request_names_the_field_in_http_names(
    http_stack: HttpStack, args: dict[str, Any], param: str
) -> None:
    """The gateway's INVALID_ARGUMENT reaches the SDK as BadRequestError whose message and param name
    the field as the client sent it (max_tokens, never sampling.max_new_tokens)."""
    with pytest.raises(openai.BadRequestError) as raised:
        client(http_stack).chat.completions.create(**{"model": MODEL, "messages": CHAT, **args})
    assert raised.value.status_code == 400
    body = raised.value.body
    assert isinstance(body, dict) and body["param"] == param and body["message"].startswith(f"{param}:")
    assert "sampling." not in body["message"] and "max_new_tokens:" not in body["message"]


def test_wrong_key_is_authentication_error_and_unknown_model_not_found(http_stack: HttpStack) -> None:
    """A wrong key is 401 (AuthenticationError) before anything runs; an unknown model is 404
    (NotFoundError) naming the models there are."""
    with pytest.raises(openai.AuthenticationError):
        client(http_stack, key="wrong").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        client(http_stack, key="wrong").models.list()
    with pytest.raises(openai.NotFoundError) as raised:
        client(http_stack).completions.create(model="nope", prompt="Hi", max_tokens=4)
    assert "'nope'" in raised.value.message and MODEL in raised.value.message


def test_rate_limit_carries_retry_after_which_the_sdk_honours(http_stack: HttpStack) -> None:
    """Tenant `tight` may run one request: a second is 429 (RateLimitError) with Retry-After and
    retry-after-ms from the quota's 1 s retry hint; with retries on, the SDK waits that long and its
    retry succeeds once the first request has ended."""
    sdk = client(http_stack, key=TIGHT_KEY)
    holder = sdk.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(holder))  # running: it holds the tenant's one slot
    with pytest.raises(openai.RateLimitError) as raised:
        sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    headers = raised.value.response.headers
    assert headers["retry-after"] == "1" and headers["retry-after-ms"] == "1000"
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == "quota_exceeded"
    threading.Timer(0.3, holder.close).start()
    started = time.monotonic()
    reply = client(http_stack, key=TIGHT_KEY, retries=2).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 0.9 <= time.monotonic() - started < 10


def test_litellm_openai_compatible_provider_stream_and_not(http_stack: HttpStack) -> None:
    """LiteLLM's `completion` with the OpenAI-compatible provider pointed at the gateway, whole and
    streamed: same greedy text both ways, usage counted."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no price map fetched over the network
    # The SDK streams the other tests left to the collector are collected now, not in the middle of
    # litellm's import of httpx, where their cleanup would find httpx half imported.
    gc.collect()
    import litellm

    args: dict[str, Any] = {
        "model": f"openai/{MODEL}",
        "api_base": http_stack.base_url,
        "api_key": KEY,
        "messages": CHAT,
        "max_tokens": 10,
        "temperature": 0,
        "num_retries": 0,
    }
    whole = litellm.completion(**args)
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    streamed = "".join(
        chunk.choices[0].delta.content or "" for chunk in litellm.completion(**args, stream=True)
    )
    assert streamed == whole.choices[0].message.content


@pytest.mark.real_model
def test_sdk_gets_paris_from_the_real_model(real_model_dir: Path) -> None:
    """Greedy chat through the SDK, whole and streamed: both say Paris, and the stream's text is the
    whole answer's (the chat template, tokenization and detokenization are the real ones)."""
    with HttpStack(real_model_dir, model=REAL_MODEL, step_delay_s=0.0) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=120)
        whole = client.chat.completions.create(
            model=REAL_MODEL, messages=QUESTION, max_tokens=32, temperature=0
        )
        text = whole.choices[0].message.content or ""
        assert "Paris" in text and whole.model == REAL_MODEL
        stream = client.chat.completions.create(
            model=REAL_MODEL, messages=QUESTION, max_tokens=32, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text
