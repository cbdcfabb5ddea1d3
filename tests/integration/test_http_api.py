"""The OpenAI-compatible HTTP API end to end, driven by the clients people use: the official openai SDK
(sync and async), LiteLLM's OpenAI-compatible provider, and curl for the wire format itself.

One real stack per module (tokenizer service, worker, gateway with its HTTP API on a free port, the
tiny random-weight model); the gateway traces into memory so that a caller's traceparent can be seen
joined. Greedy requests (temperature 0) make a stream's text comparable with the whole answer's.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any

import httpx2
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from strata.tracing import Tracing
from tests.integration.http_harness import KEY, MAX_BODY, MODEL, TIGHT_KEY, HttpStack, start_http_stack

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from openai.types.chat import ChatCompletionMessageParam

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
STAGES = ("network", "preprocess", "queue", "forward", "decode")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def stack(tiny_serving_dir: Path) -> Iterator[HttpStack]:
    tracing = Tracing.with_exporter("g", InMemorySpanExporter(), 1.0, batch=False)
    running = start_http_stack(tiny_serving_dir, tracing=tracing)
    try:
        yield running
    finally:
        running.close()


def client(stack: HttpStack, key: str = KEY, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=retries, timeout=60)


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["curl", "-sS", *args], capture_output=True, text=True, timeout=60, check=True)


def post(stack: HttpStack, path: str, body: str, *headers: str) -> tuple[int, dict[str, str], str]:
    """curl's status, headers (lower-cased names) and body for a POST of `body`."""
    auth = ("-H", f"Authorization: Bearer {KEY}")
    hdrs = [arg for header in headers for arg in ("-H", header)]
    done = curl(
        "-i",
        "-N",
        stack.base_url + path,
        *auth,
        *hdrs,
        "-H",
        "content-type: application/json",
        "--data-binary",
        body,
    )
    head, _, payload = done.stdout.replace("\r\n", "\n").partition("\n\n")
    status_line, *lines = head.split("\n")
    fields = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), fields, payload


def test_sdk_chat_completion_has_openai_shape_and_strata_headers(stack: HttpStack) -> None:
    """A whole chat completion through the sync SDK: OpenAI's shape, the serving model, the finish
    reason and usage, and the headers that say who served it and where the time went."""
    raw = client(stack).chat.completions.with_raw_response.create(
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


def test_sdk_stream_adds_up_to_the_whole_answer_with_usage_last(stack: HttpStack) -> None:
    """A greedy stream's deltas add up to the whole answer; with include_usage the last chunk has no
    choices and the usage, and carries the `strata` extension (request id, trace, timing)."""
    sdk = client(stack)
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


def test_async_sdk_completions_stream_and_not(stack: HttpStack) -> None:
    """The async SDK on /v1/completions: a prompt string, stop and seed accepted, a text_completion
    object, and the stream's text equal to the whole one."""

    async def both() -> tuple[Any, list[Any]]:
        sdk = openai.AsyncOpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60)
        async with sdk:
            args: dict[str, Any] = {"model": MODEL, "prompt": "Once upon", "max_tokens": 10, "temperature": 0}
            whole = await sdk.completions.create(**args, seed=3, stop=["\n\n"])
            stream = await sdk.completions.create(**args, seed=3, stop=["\n\n"], stream=True)
            return whole, [chunk async for chunk in stream]

    whole, chunks = asyncio.run(both())
    assert whole.object == "text_completion" and whole.model == MODEL and whole.choices[0].text
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_models_list_names_the_routes(stack: HttpStack) -> None:
    """GET /v1/models lists every route as an OpenAI model object."""
    models = client(stack).models.list()
    assert [model.id for model in models.data] == [MODEL]
    assert models.data[0].object == "model" and models.data[0].owned_by == "strata"


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"extra_body": {"top_k": -1}}, "top_k"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_bad_request_names_the_field_in_http_names(
    stack: HttpStack, args: dict[str, Any], param: str
) -> None:
    """The gateway's INVALID_ARGUMENT reaches the SDK as BadRequestError whose message and param name
    the field as the client sent it (max_tokens, never sampling.max_new_tokens)."""
    with pytest.raises(openai.BadRequestError) as raised:
        client(stack).chat.completions.create(**{"model": MODEL, "messages": CHAT, **args})
    assert raised.value.status_code == 400
    body = raised.value.body
    assert isinstance(body, dict) and body["param"] == param and body["message"].startswith(f"{param}:")
    assert "sampling." not in body["message"] and "max_new_tokens:" not in body["message"]


def test_wrong_key_is_authentication_error_and_unknown_model_not_found(stack: HttpStack) -> None:
    """A wrong key is 401 (AuthenticationError) before anything runs; an unknown model is 404
    (NotFoundError) naming the models there are."""
    with pytest.raises(openai.AuthenticationError):
        client(stack, key="wrong").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        client(stack, key="wrong").models.list()
    with pytest.raises(openai.NotFoundError) as raised:
        client(stack).completions.create(model="nope", prompt="Hi", max_tokens=4)
    assert "'nope'" in raised.value.message and MODEL in raised.value.message


def test_rate_limit_carries_retry_after_which_the_sdk_honours(stack: HttpStack) -> None:
    """Tenant `tight` may run one request: a second is 429 (RateLimitError) with Retry-After and
    retry-after-ms from the quota's 1 s retry hint; with retries on, the SDK waits that long and its
    retry succeeds once the first request has ended."""
    sdk = client(stack, key=TIGHT_KEY)
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
    reply = client(stack, key=TIGHT_KEY, retries=2).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 0.9 <= time.monotonic() - started < 10


def test_litellm_openai_compatible_provider_stream_and_not(stack: HttpStack) -> None:
    """LiteLLM's `completion` with the OpenAI-compatible provider pointed at the gateway, whole and
    streamed: same greedy text both ways, usage counted."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no price map fetched over the network
    import litellm

    args: dict[str, Any] = {
        "model": f"openai/{MODEL}",
        "api_base": stack.base_url,
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


def test_curl_sees_sse_framing_then_done(stack: HttpStack) -> None:
    """The wire format: text/event-stream, every event one `data:` line and a blank line, chunk objects
    with one id, then `data: [DONE]` last."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "stream": True}
    status, headers, payload = post(stack, "/chat/completions", json.dumps(body))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = payload.strip("\n").split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    assert events[-1] == "data: [DONE]"
    objects = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert {item["object"] for item in objects} == {"chat.completion.chunk"}
    assert objects[-1]["choices"][0]["finish_reason"] == "length" and "strata" in objects[-1]


def test_traceparent_joins_the_callers_trace(stack: HttpStack) -> None:
    """A caller's traceparent header makes the request part of its trace: the trace id comes back."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    status, headers, _ = post(
        stack, "/completions", json.dumps(body), f"traceparent: 00-{TRACE_ID}-00f067aa0ba902b7-01"
    )
    assert status == 200 and headers["x-strata-trace-id"] == TRACE_ID


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("{not json", None),
        ("[1, 2]", None),
        ('{"messages": "hi"}', "messages"),
        ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": "8"}', "max_tokens"),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            "messages[0].content[0].type",
        ),
        ('{"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}', "frobnicate"),
        ('{"messages": [{"role": "user", "content": "x"}], "n": 3}', "n"),
        ('{"messages": [{"role": "user", "content": "x"}], "logprobs": true}', "logprobs"),
        ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', "tools"),
        ('{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}', "presence_penalty"),
    ],
)
def test_malformed_or_unsupported_bodies_are_400_naming_the_field(
    stack: HttpStack, body: str, param: str | None
) -> None:
    """Bodies that are not JSON, not an object, of a wrong type, or that ask for a feature the
    gateway lacks are 400 with OpenAI's error body naming the field; never a 500, never ignored."""
    status, _, payload = post(stack, "/chat/completions", body)
    error = json.loads(payload)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["message"].startswith(f"{param}:")


def test_habitual_default_fields_are_accepted(stack: HttpStack) -> None:
    """What LangChain and LiteLLM send by habit, at default values, is accepted."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        "max_tokens": 3,
        "n": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logprobs": False,
        "user": "someone",
        "parallel_tool_calls": True,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "service_tier": "auto",
        "store": False,
        "stream": False,
        "stream_options": {"include_usage": False},
    }
    status, _, payload = post(stack, "/chat/completions", json.dumps(body))
    assert status == 200, payload
    assert json.loads(payload)["usage"]["completion_tokens"] <= 3


def test_body_over_the_limit_is_413(stack: HttpStack) -> None:
    """A body over max_message_bytes is refused with 413 before it is parsed."""
    body = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY})
    status, _, payload = post(stack, "/completions", body)
    assert status == 413 and json.loads(payload)["error"]["code"] == "request_too_large"


def test_health_is_200_while_serving(stack: HttpStack) -> None:
    """GET /health is readiness: 200 while the gateway serves (503 before and while draining:
    test_http_cancel.py), and needs no key."""
    done = curl("-o", "/dev/null", "-w", "%{http_code}", stack.origin + "/health")
    assert done.stdout == "200"


def test_first_event_leaves_with_the_headers(stack: HttpStack) -> None:
    """A stream's first event follows its headers at once: with Nagle's algorithm on the server's
    sockets it would wait for the client's delayed ACK (about 40 ms on Linux) on every stream."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}

    async def gaps() -> list[float]:
        measured = []
        async with httpx2.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
            for _ in range(6):
                async with http.stream(
                    "POST", f"{stack.base_url}/completions", json=body, timeout=30
                ) as reply:
                    headers_at = time.perf_counter()
                    first: float | None = None
                    async for line in reply.aiter_lines():  # to the end: the connection is kept
                        if line.startswith("data: ") and first is None:
                            first = time.perf_counter() - headers_at
                    assert first is not None
                    measured.append(first)
        return measured

    measured = asyncio.run(gaps())
    assert sorted(measured)[3] < 0.02, measured
