"""Anthropic's Messages API driven by the official anthropic SDK against a real stack: whole answers and
streams, stop sequences, tool use round trips, count_tokens, and every refusal in Anthropic's error shape.

One real stack per module (tokenizer service, worker, gateway with its HTTP API; the tiny random model
with a long context, whose unconstrained text is noise: a tool call that parses is the grammar's doing).
Greedy requests (temperature 0) make a stream's text comparable with the whole answer's. The 529 of an
overloaded route is mapped in tests/unit/test_anthropic_api.py: provoking admission's refusal here
would hang on this machine's speed.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import httpx2
import jsonschema
import pytest

from bench.http_driver import messages_body, send_messages
from tests.grammar_cases import WEATHER
from tests.integration.http_harness import KEY, MAX_BODY, MODEL, TIGHT_KEY, HttpStack, curl_events
from tests.polling import wait_for

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from anthropic.types import MessageParam, ToolParam

    from bench.driver import RequestResult

QUESTION: list[MessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS: list[ToolParam] = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
GREEDY = {"temperature": 0}
"""The SDK's signature has no temperature any more; the API takes it, and the tests want greedy text."""


@pytest.fixture(scope="module")
def stack(tiny_long_serving_dir: Path) -> Iterator[HttpStack]:
    with HttpStack(tiny_long_serving_dir, step_delay_s=0.0) as running:
        yield running


def client(stack: HttpStack, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.origin, api_key=key, max_retries=0, timeout=60)


def post(stack: HttpStack, body: Any, path: str = "/v1/messages", **headers: str) -> httpx.Response:
    return httpx.post(f"{stack.origin}{path}", json=body, headers={**HEADERS, **headers}, timeout=60)


def test_a_whole_message_and_its_stream_say_the_same(stack: HttpStack) -> None:
    """A greedy answer whole and streamed: Anthropic's message shape, the same text, stop reason and
    usage; the stream's events come in Anthropic's order."""
    sdk = client(stack)
    whole = sdk.messages.create(model=MODEL, max_tokens=12, messages=QUESTION, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_") and whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    (block,) = whole.content
    assert block.type == "text" and block.text
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    with sdk.messages.stream(model=MODEL, max_tokens=12, messages=QUESTION, extra_body=GREEDY) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    kinds = [event.type for event in events]
    start = events[0]
    assert start.type == "message_start"
    started = start.message.usage
    assert started.input_tokens + (started.cache_read_input_tokens or 0) == whole.usage.input_tokens + (
        whole.usage.cache_read_input_tokens or 0
    ), "message_start tells the prompt's tokens, as Anthropic's does"
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert [b.text for b in streamed.content if b.type == "text"] == [block.text]
    assert streamed.stop_reason == "max_tokens" and streamed.id.startswith("msg_")
    assert streamed.usage.output_tokens == 12
    assert streamed.usage.input_tokens + (
        streamed.usage.cache_read_input_tokens or 0
    ) == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_a_stop_sequence_ends_the_text_and_is_named(stack: HttpStack) -> None:
    """A stop sequence taken from the greedy answer's own text cuts it where it begins: stop_reason
    stop_sequence and the string that matched, whole and streamed."""
    sdk = client(stack)
    free = sdk.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, extra_body=GREEDY)
    text = free.content[0].text  # type: ignore[union-attr]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3, text
    cut = sdk.messages.create(
        model=MODEL, max_tokens=24, messages=QUESTION, extra_body=GREEDY, stop_sequences=["\x00never", stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    with sdk.messages.stream(
        model=MODEL, max_tokens=24, messages=QUESTION, extra_body=GREEDY, stop_sequences=[stop]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_tool_use_round_trip_whole_and_streamed(stack: HttpStack) -> None:
    """A named tool choice makes a tool_use block whose input follows the schema (stop_reason
    tool_use); streamed with `any` and disable_parallel_tool_use, one call whose input arrives in
    input_json_delta fragments; the call and its tool_result go back in the conversation and are
    accepted."""
    sdk = client(stack)
    choice: Any = {"type": "tool", "name": "get_weather"}
    reply = sdk.messages.create(
        model=MODEL, max_tokens=96, messages=QUESTION, tools=TOOLS, tool_choice=choice, extra_body=GREEDY
    )
    assert reply.stop_reason == "tool_use"
    (call,) = reply.content
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    with sdk.messages.stream(
        model=MODEL,
        max_tokens=96,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert deltas.count("input_json_delta") > 1, "the input comes in fragments as it is written"
    assert streamed.stop_reason == "tool_use"
    (streamed_call,) = streamed.content  # one call: disable_parallel_tool_use
    assert streamed_call.type == "tool_use"
    jsonschema.validate(streamed_call.input, WEATHER)
    follow_up: list[Any] = [
        *QUESTION,
        {"role": "assistant", "content": [call.model_dump()]},  # type: ignore[list-item]
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 21}'}],
        },
    ]
    after = sdk.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=follow_up,
        tools=TOOLS,
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert after.stop_reason == "max_tokens" and after.content[0].type == "text"


def test_output_config_format_makes_the_answer_follow_the_schema(stack: HttpStack) -> None:
    """output_config.format's JSON schema is structured output: the tiny model's noise becomes a JSON
    object that the schema accepts."""
    reply = client(stack).messages.create(
        model=MODEL,
        max_tokens=96,
        messages=QUESTION,
        output_config={"format": {"type": "json_schema", "schema": WEATHER}},
        extra_body=GREEDY,
    )
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(reply.content[0].text), WEATHER)  # type: ignore[union-attr]


def test_count_tokens_is_what_the_prompt_takes(stack: HttpStack) -> None:
    """count_tokens answers the prompt tokens the same conversation takes when it runs, with a system
    prompt and tools, which add to the count."""
    sdk = client(stack)
    system = "Answer briefly."
    counted = sdk.messages.count_tokens(model=MODEL, messages=QUESTION, system=system, tools=TOOLS)
    ran = sdk.messages.create(model=MODEL, max_tokens=1, messages=QUESTION, system=system, tools=TOOLS)
    assert counted.input_tokens == ran.usage.input_tokens + (ran.usage.cache_read_input_tokens or 0)
    bare = sdk.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert 0 < bare.input_tokens < counted.input_tokens


def _error(response: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return dict(body["error"])


def test_every_refusal_has_anthropics_shape_and_status(stack: HttpStack) -> None:
    """No key, an unknown model, a missing or mistyped field, an image block, a turn holding a block
    of the other role (a call or reasoning in a user turn), no anthropic-version header, an oversized
    body, a tenant over its quota: each gets Anthropic's status and error type, with a message naming
    the field or the limit."""
    with pytest.raises(anthropic.AuthenticationError) as unauthenticated:
        client(stack, key="wrong").messages.create(model=MODEL, max_tokens=4, messages=QUESTION)
    assert unauthenticated.value.status_code == 401 and "x-api-key" in str(unauthenticated.value)
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client(stack).messages.create(model="no-such-model", max_tokens=4, messages=QUESTION)
    assert "no-such-model" in str(unknown.value)
    base = {"model": MODEL, "max_tokens": 4, "messages": QUESTION}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    call = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    thought = {"type": "thinking", "thinking": "x"}
    cases = [
        ({"model": MODEL, "messages": QUESTION}, "max_tokens"),
        ({**base, "max_tokens": "4"}, "max_tokens"),
        ({**base, "temperature": 1.5}, "temperature"),
        ({**base, "top_k": -1}, "top_k"),
        ({**base, "messages": [{"role": "user", "content": [image]}]}, "messages[0]"),
        ({**base, "messages": [{"role": "user", "content": [call]}]}, "assistant turn"),
        ({**base, "messages": [{"role": "user", "content": [thought]}]}, "assistant turn"),
        ({**base, "surprise": 1}, "surprise"),
    ]  # fmt: skip
    for body, named in cases:
        response = post(stack, body)
        assert response.status_code == 400, (body, response.text)
        error = _error(response)
        assert error["type"] == "invalid_request_error" and named in error["message"], (body, error)
    missing = httpx.post(f"{stack.origin}/v1/messages", json=base, headers={"x-api-key": KEY}, timeout=60)
    assert missing.status_code == 400 and "anthropic-version" in _error(missing)["message"]
    large = post(stack, {**base, "system": "x" * (MAX_BODY + 1)})
    assert large.status_code == 413 and _error(large)["type"] == "request_too_large"
    tight = httpx.Client(timeout=60)
    with tight.stream(
        "POST",
        f"{stack.origin}/v1/messages",
        json={**base, "max_tokens": 200, "stream": True},
        headers={**HEADERS, "x-api-key": TIGHT_KEY},
    ) as held:
        assert held.status_code == 200
        quota = post(stack, base, **{"x-api-key": TIGHT_KEY})
        assert quota.status_code == 429 and _error(quota)["type"] == "rate_limit_error"
        assert int(quota.headers["retry-after"]) >= 1
    tight.close()
    wait_for(stack.idle, 60, "the tight tenant's stream let go of its KV blocks")


def test_a_client_that_walks_away_from_a_stream_frees_its_blocks(stack: HttpStack) -> None:
    """A stream whose client closes after its first event is cancelled on the worker: no KV block
    stays used, and the next request is served."""
    body = {"model": MODEL, "max_tokens": 400, "messages": QUESTION, "stream": True}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{stack.origin}/v1/messages", json=body, headers=HEADERS) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("event: message_start")
    wait_for(stack.idle, 60, "the abandoned stream let go of its KV blocks")
    after = client(stack).messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
    assert after.usage.output_tokens <= 2
    assert json.dumps(after.model_dump())  # a plain, serializable message


def test_the_bench_driver_reads_the_stream_as_the_sdk_does(stack: HttpStack) -> None:
    """bench/http_driver.py's Messages reader (make bench-http) gets the SDK's text and token counts
    from the same greedy request, streamed."""
    whole = client(stack).messages.create(model=MODEL, max_tokens=10, messages=QUESTION, extra_body=GREEDY)

    async def read() -> RequestResult:
        async with httpx2.AsyncClient(headers={"x-api-key": KEY}) as http:
            payload = messages_body("What is the weather in Paris?", 10, MODEL)
            return await send_messages(http, f"{stack.origin}/v1/messages", 0, payload, 60)

    result = asyncio.run(read())
    assert result.status == "OK" and result.text == whole.content[0].text  # type: ignore[union-attr]
    assert result.usage_output_tokens == 10
    usage = whole.usage
    assert result.usage_input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_curl_sees_each_event_named_as_its_data_says(stack: HttpStack) -> None:
    """The raw framing, as curl prints it: every event an `event:` line and a `data:` line whose JSON
    has the same type, in Anthropic's order."""
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "stream": True}
    events = curl_events(f"{stack.origin}/v1/messages", body, HEADERS)
    assert all(name == data["type"] for name, data in events)
    assert events[0][0] == "message_start" and [name for name, _ in events[-2:]] == [
        "message_delta",
        "message_stop",
    ]
