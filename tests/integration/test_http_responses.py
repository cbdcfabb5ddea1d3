"""OpenAI's Responses API driven by the official openai SDK against a real stack: whole answers and
streams, continuations through previous_response_id and the per-tenant store, function calls and
their outputs, structured output, and every refusal in OpenAI's error shape.

One real stack per module (tokenizer service, worker, gateway with its HTTP API; the tiny random model
with a long context, whose unconstrained text is noise: a call that parses is the grammar's doing).
Greedy requests (temperature 0) make a stream's text comparable with the whole answer's. The store's
time limit and size cap are tested with a clock of the test's own in tests/unit/test_responses_api.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import httpx
import httpx2
import jsonschema
import openai
import pytest

from bench.http_driver import responses_body, send_responses
from tests.grammar_cases import WEATHER
from tests.integration.http_harness import KEY, MAX_BODY, MODEL, TIGHT_KEY, HttpStack, curl_events
from tests.polling import wait_for

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from openai.types.responses import FunctionToolParam, ToolChoiceFunctionParam

    from bench.driver import RequestResult

QUESTION = "What is the weather in Paris?"
TOOLS: list[FunctionToolParam] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather",
        "parameters": WEATHER,
        "strict": True,
    }
]


@pytest.fixture(scope="module")
def stack(tiny_long_serving_dir: Path) -> Iterator[HttpStack]:
    with HttpStack(tiny_long_serving_dir, step_delay_s=0.0) as running:
        yield running


def client(stack: HttpStack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=60)


def post(stack: HttpStack, body: Any, key: str = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{stack.base_url}/responses", json=body, headers=headers, timeout=60)


def test_a_whole_response_and_its_stream_say_the_same(stack: HttpStack) -> None:
    """A greedy answer whole and streamed: the response object's shape, the same text and usage, status
    incomplete when max_output_tokens stopped it; the stream's events come in the API's order with
    increasing sequence numbers, and the SDK's stream helper rebuilds a completed response."""
    sdk = client(stack)
    whole = sdk.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == MODEL
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    (item,) = whole.output
    assert item.type == "message" and item.role == "assistant" and whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    events = list(
        sdk.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0, stream=True)
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text
    ended = events[-1]
    assert ended.type == "response.incomplete" and ended.response.output_text == whole.output_text
    # The SDK's helper rebuilds a completed response only (an incomplete one ends its stream without
    # one, as OpenAI's does): structured output ends on its own, before the token limit.
    shaped: Any = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}}
    asked = {"model": MODEL, "input": QUESTION, "max_output_tokens": 96, "temperature": 0, "text": shaped}
    with sdk.responses.stream(**asked) as stream:
        for _ in stream:
            pass
        rebuilt = stream.get_final_response()
    alone = sdk.responses.create(**asked)
    assert rebuilt.status == "completed" and rebuilt.output_text == alone.output_text
    assert rebuilt.usage is not None and alone.usage is not None
    assert rebuilt.usage.output_tokens == alone.usage.output_tokens


def test_previous_response_id_continues_the_stored_conversation(stack: HttpStack) -> None:
    """A continuation reads the earlier input and answer before its own input (more prompt tokens, the
    earlier prompt served from the prefix cache), instructions are not carried over; GET returns a
    stored response, DELETE forgets it; store false keeps nothing; another tenant cannot see it."""
    sdk = client(stack)
    first = sdk.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0)
    assert first.usage is not None
    later = sdk.responses.create(
        model=MODEL, input="And in Rome?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    assert later.previous_response_id == first.id and later.usage is not None
    assert later.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert later.usage.input_tokens_details.cached_tokens > 0, "the earlier turns are a cached prefix"
    fetched = sdk.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        client(stack, TIGHT_KEY).responses.retrieve(first.id)
    refused = post(stack, {"model": MODEL, "input": "hi", "previous_response_id": first.id}, key=TIGHT_KEY)
    assert refused.status_code == 404
    assert refused.json()["error"]["param"] == "previous_response_id"
    sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        sdk.responses.create(model=MODEL, input="again", previous_response_id=first.id, max_output_tokens=2)
    assert gone.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    unkept = sdk.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unkept.id)


def test_function_call_round_trip_whole_and_streamed(stack: HttpStack) -> None:
    """A required tool choice makes function_call items whose arguments follow the schema; streamed,
    a call's item is added before its arguments, which arrive in fragments as they are written; the
    call and its function_call_output go back as input (as the SDK's output items) and are answered
    in text."""
    sdk = client(stack)
    reply = sdk.responses.create(
        model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="required", max_output_tokens=96, temperature=0
    )
    assert reply.output and len({item.id for item in reply.output}) == len(reply.output)
    for item in reply.output:  # `required` allows one call or several
        assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
        jsonschema.validate(json.loads(item.arguments), WEATHER)
    call = reply.output[0]
    assert call.type == "function_call"
    named: ToolChoiceFunctionParam = {"type": "function", "name": "get_weather"}
    events = list(
        sdk.responses.create(
            model=MODEL,
            input=QUESTION,
            tools=TOOLS,
            tool_choice=named,
            max_output_tokens=96,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds.count("response.function_call_arguments.delta") > 1, "fragments as they are written"
    assert kinds[-1] == "response.completed" and kinds.index("response.output_item.added") < kinds.index(
        "response.function_call_arguments.delta"
    )
    fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    assert done.arguments == fragments  # type: ignore[union-attr]
    jsonschema.validate(json.loads(fragments), WEATHER)
    follow_up: Any = [
        {"role": "user", "content": QUESTION},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'},
    ]
    after = sdk.responses.create(
        model=MODEL, input=follow_up, tools=TOOLS, tool_choice="none", max_output_tokens=8, temperature=0
    )
    bare = sdk.responses.create(
        model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="none", max_output_tokens=1
    )
    assert after.output[0].type == "message" and after.usage is not None and bare.usage is not None
    assert after.usage.input_tokens > bare.usage.input_tokens + 10, (
        "the call and its output are in the prompt"
    )


def test_text_format_json_schema_makes_the_answer_follow_it(stack: HttpStack) -> None:
    """text.format's JSON schema is structured output: the tiny model's noise becomes a JSON object the
    schema accepts."""
    reply = client(stack).responses.create(
        model=MODEL,
        input=QUESTION,
        max_output_tokens=96,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}},
        temperature=0,
    )
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), WEATHER)


def test_every_refusal_has_openais_shape_and_names_the_field(stack: HttpStack) -> None:
    """No key, an unknown model, a missing or mistyped field, an image part, a tool that is not a
    function, background, an unknown previous_response_id, an oversized body, a tenant over its quota:
    each gets its status and OpenAI's error body naming the field."""
    with pytest.raises(openai.AuthenticationError):
        client(stack, key="wrong").responses.create(model=MODEL, input=QUESTION)
    with pytest.raises(openai.NotFoundError) as unknown:
        client(stack).responses.create(model="no-such-model", input=QUESTION)
    assert "no-such-model" in str(unknown.value)
    base = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4}
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,"}]}
    cases = [
        ({"model": MODEL}, "input"),
        ({**base, "max_output_tokens": "4"}, "max_output_tokens"),
        ({**base, "max_output_tokens": 0}, "max_output_tokens"),
        ({**base, "temperature": 2.5}, "temperature"),
        ({**base, "input": [image]}, "input[0]"),
        ({**base, "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({**base, "background": True}, "background"),
        ({**base, "include": ["message.output_text.logprobs"]}, "include"),
        ({**base, "tool_choice": "required"}, "tool_choice"),
        ({**base, "surprise": 1}, "surprise"),
    ]  # fmt: skip
    for body, named in cases:
        response = post(stack, body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and named in (error["param"] or ""), (body, error)
    missing = post(stack, {**base, "previous_response_id": "resp_nothing"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "previous_response_not_found"
    large = post(stack, {**base, "instructions": "x" * (MAX_BODY + 1)})
    assert large.status_code == 413
    tight = httpx.Client(timeout=60)
    with tight.stream(
        "POST",
        f"{stack.base_url}/responses",
        json={**base, "max_output_tokens": 200, "stream": True},
        headers={"authorization": f"Bearer {TIGHT_KEY}"},
    ) as held:
        assert held.status_code == 200
        quota = post(stack, base, key=TIGHT_KEY)
        assert quota.status_code == 429 and int(quota.headers["retry-after"]) >= 1
    tight.close()
    wait_for(stack.idle, 60, "the tight tenant's stream let go of its KV blocks")


def test_the_raw_stream_is_named_events_and_a_walkaway_frees_its_blocks(stack: HttpStack) -> None:
    """On the wire each event is an `event:` line naming its type and a `data:` line whose JSON says
    the same type; a client that closes after the first event has its request cancelled on the worker:
    no KV block stays used, and the next request is served."""
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 400, "stream": True}
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{stack.base_url}/responses", json=body, headers={"authorization": f"Bearer {KEY}"}
        ) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        name, data = next(lines), next(lines)
        assert name == "event: response.created"
        assert json.loads(data.removeprefix("data: "))["type"] == "response.created"
    wait_for(stack.idle, 60, "the abandoned stream let go of its KV blocks")
    after = client(stack).responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    assert after.usage is not None and after.usage.output_tokens <= 2


def test_the_bench_driver_reads_the_stream_as_the_sdk_does(stack: HttpStack) -> None:
    """bench/http_driver.py's Responses reader (make bench-http) gets the SDK's text and token counts
    from the same greedy request, streamed."""
    whole = client(stack).responses.create(model=MODEL, input=QUESTION, max_output_tokens=10, temperature=0)

    async def read() -> RequestResult:
        async with httpx2.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
            payload = responses_body(QUESTION, 10, MODEL)
            return await send_responses(http, f"{stack.base_url}/responses", 0, payload, 60)

    result = asyncio.run(read())
    assert result.status == "OK" and result.text == whole.output_text
    assert whole.usage is not None and result.usage_output_tokens == 10
    assert result.usage_input_tokens == whole.usage.input_tokens and result.ttft_s is not None


def test_curl_sees_each_event_named_as_its_data_says(stack: HttpStack) -> None:
    """The raw framing, as curl prints it: every event an `event:` line and a `data:` line whose JSON
    has the same type, in the API's order."""
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, "stream": True}
    events = curl_events(f"{stack.base_url}/responses", body, {"authorization": f"Bearer {KEY}"})
    assert all(name == data["type"] for name, data in events)
    assert events[0][0] == "response.created" and events[-1][0] == "response.incomplete"
