"""The OpenAI-compatible HTTP API's wire format, as curl and a bare HTTP client see it: the SSE framing,
the headers (Server-Timing, the trace a traceparent joins), the answers to malformed, mistyped,
unsupported and oversized bodies, the fields clients send by habit, readiness, and a stream's first
event leaving with its headers.

One real stack per module (http_harness.py); the gateway traces into memory so that a caller's
traceparent can be seen joined.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from typing import TYPE_CHECKING

import httpx2
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from strata.tracing import Tracing
from tests.integration.http_harness import KEY, MAX_BODY, MODEL, HttpStack

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

CHAT = [{"role": "user", "content": "Hello there"}]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def stack(tiny_serving_dir: Path) -> Iterator[HttpStack]:
    tracing = Tracing.with_exporter("g", InMemorySpanExporter(), 1.0, batch=False)
    with HttpStack(tiny_serving_dir, tracing=tracing) as running:
        yield running


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


def test_curl_sees_anthropics_named_events(stack: HttpStack) -> None:
    """The Messages API's wire format: every event an `event:` line naming its type and one `data:`
    line holding it, in Anthropic's order, no `[DONE]`."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "stream": True}
    status, headers, payload = post(stack, "/messages", json.dumps(body), "anthropic-version: 2023-06-01")
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [event.split("\n") for event in payload.strip("\n").split("\n\n")]
    assert all(len(lines) == 2 and lines[0].startswith("event: ") for lines in events), events
    named = [
        (lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: "))) for lines in events
    ]
    assert all(kind == data["type"] for kind, data in named)
    kinds = [kind for kind, _ in named]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    assert (
        named[-2][1]["delta"]["stop_reason"] == "max_tokens" and named[-2][1]["usage"]["output_tokens"] == 6
    )


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
        ('{"messages": [{"role": "user", "content": "x"}], "n": 17}', "n"),
        ('{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs"),
        (
            '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}',
            "top_logprobs",
        ),
        ('{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}', "logit_bias"),
        ('{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"3": 101}}', "logit_bias"),
        ('{"messages": [{"role": "user", "content": "x"}], "min_p": 1.5}', "min_p"),
        ('{"messages": [{"role": "user", "content": "x"}], "typical_p": 0}', "typical_p"),
        ('{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}', "presence_penalty"),
        ('{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -3}', "frequency_penalty"),
        (
            '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
            "tools[0].function",
        ),
        ('{"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}', "functions"),
        (
            '{"messages": [{"role": "user", "content": "x"}], "n": 2, '
            '"tools": [{"type": "function", "function": {"name": "f"}}]}',
            "n",
        ),
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
