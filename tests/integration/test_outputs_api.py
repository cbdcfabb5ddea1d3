"""Log probabilities and the OpenAI/vLLM penalties and filters through the whole stack: the official
openai SDK reading `choices[i].logprobs.content[j].top_logprobs` (chat, streamed and not) and the
legacy completions shape, and the gRPC API's token ids showing each processor acted.

One real stack per module (conftest.py's http_stack: tokenizer service, worker, gateway with its HTTP
API, the tiny random-weight model). Greedy requests make the chosen token the most likely one, so its
logprob is the top one's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import grpc
import openai
import pytest

from strata.client import StrataClient
from tests.integration.http_harness import KEY, MODEL, HttpStack
from tests.polling import wait_for

if TYPE_CHECKING:
    from collections.abc import Iterator

    from openai.types.chat import ChatCompletionMessageParam

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def grpc_client(http_stack: HttpStack) -> Iterator[StrataClient]:
    with StrataClient(http_stack.gateway_address, api_key=KEY) as client:
        yield client


def sdk(http_stack: HttpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_stack.base_url, api_key=KEY, max_retries=0, timeout=60)


def test_sdk_reads_chat_top_logprobs(http_stack: HttpStack) -> None:
    reply = sdk(http_stack).chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == 6
    for position in content:
        assert len(position.top_logprobs) == 3
        values = [top.logprob for top in position.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # Greedy takes the raw argmax, so the chosen token is the most likely one.
        assert position.logprob == pytest.approx(values[0], abs=1e-6)
        assert position.token == position.top_logprobs[0].token
        assert position.bytes is not None and position.token == bytes(position.bytes).decode(errors="replace")
    assert sum(math.exp(v.logprob) for v in content[0].top_logprobs) <= 1.0 + 1e-5
    # Without asking, none.
    plain = sdk(http_stack).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_streamed_chat_logprobs_cover_every_token(http_stack: HttpStack) -> None:
    whole = sdk(http_stack).chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    stream = sdk(http_stack).chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        position
        for chunk in stream
        for choice in chunk.choices
        if choice.logprobs is not None and choice.logprobs.content
        for position in choice.logprobs.content
    ]
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content is not None
    expected = [(p.token, round(p.logprob, 5)) for p in whole.choices[0].logprobs.content]
    assert [(p.token, round(p.logprob, 5)) for p in streamed] == expected


def test_completions_return_the_legacy_logprobs_shape_and_prompt_logprobs(http_stack: HttpStack) -> None:
    reply = sdk(http_stack).completions.create(
        model=MODEL,
        prompt="once upon a time",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True, "prompt_logprobs": 1},
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert logprobs.top_logprobs is not None and all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    assert reply.usage is not None
    prompt = reply.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert prompt[0] is None and len(prompt) == reply.usage.prompt_tokens
    assert all(1 <= len(entry) <= 2 for entry in prompt[1:])


def test_grpc_logprobs_name_each_token(grpc_client: StrataClient) -> None:
    reply = grpc_client.generate("hello world", max_new_tokens=5, logprobs=4, ignore_eos=True)
    assert [p.chosen.token_id for p in reply.logprobs] == list(reply.token_ids)
    assert all(len(p.top) == 4 and p.rank >= 1 for p in reply.logprobs)
    assert all(p.chosen.token_bytes.decode(errors="replace") == p.chosen.token for p in reply.logprobs)
    streamed = list(grpc_client.generate_stream("hello world", max_new_tokens=5, logprobs=4, ignore_eos=True))
    assert [p.chosen.token_id for m in streamed for p in m.logprobs] == list(reply.token_ids)


def test_processors_act_end_to_end(grpc_client: StrataClient) -> None:
    greedy = grpc_client.generate("hello world", max_new_tokens=8, ignore_eos=True)
    forced = grpc_client.generate("hello world", max_new_tokens=4, logit_bias={5: 100.0}, ignore_eos=True)
    assert list(forced.token_ids) == [5, 5, 5, 5]
    first = greedy.token_ids[0]
    stopped = grpc_client.generate("hello world", max_new_tokens=8, stop_token_ids=[first])
    assert list(stopped.token_ids) == [first] and stopped.finish_reason == 1  # FINISH_REASON_STOP
    held = grpc_client.generate("hello world", max_new_tokens=8, stop_token_ids=[first], min_tokens=5)
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:5]
    # A presence penalty of 2 against a forced repeat: the bias wins over it once it is large enough.
    repeated = grpc_client.generate(
        "hello world", max_new_tokens=6, presence_penalty=2.0, frequency_penalty=2.0, ignore_eos=True
    )
    assert len(set(repeated.token_ids)) >= len(set(greedy.token_ids[:6]))


def test_typical_p_reaches_the_sampler_over_grpc_and_http(
    grpc_client: StrataClient, http_stack: HttpStack
) -> None:
    """A tiny typical_p keeps only the one token nearest the entropy, so two seeds write the same
    text, which they do not without it; the HTTP API's extra body field gets the same."""

    def sample(seed: int, typical_p: float | None) -> tuple[int, ...]:
        response = grpc_client.generate(
            "hello world", max_new_tokens=8, temperature=1.0, ignore_eos=True, seed=seed, typical_p=typical_p
        )
        return tuple(response.token_ids)

    assert len({sample(seed, None) for seed in (1, 2, 3)}) > 1
    typical = {sample(seed, 1e-6) for seed in (1, 2, 3)}
    assert len(typical) == 1
    completion = sdk(http_stack).completions.create(
        model=MODEL,
        prompt="hello world",
        max_tokens=8,
        seed=4,
        extra_body={"typical_p": 1e-6, "ignore_eos": True},
    )
    expected = grpc_client.generate(
        "hello world", max_new_tokens=8, temperature=1.0, ignore_eos=True, seed=5, typical_p=1e-6
    )
    assert completion.choices[0].text == expected.text


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"presence_penalty": 2.5}, "sampling.presence_penalty"),
        ({"min_p": -0.5}, "sampling.min_p"),
        ({"typical_p": 1.5}, "sampling.typical_p"),
        ({"logit_bias": {3: 150.0}}, "sampling.logit_bias"),
        ({"logprobs": 21}, "sampling.top_logprobs"),
        ({"min_tokens": 9, "max_new_tokens": 8}, "sampling.min_tokens"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
    ],
)
def test_bad_processor_values_are_invalid_argument_naming_the_field(
    grpc_client: StrataClient, http_stack: HttpStack, options: dict[str, object], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        grpc_client.generate("hello", **options)  # type: ignore[arg-type]
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in raised.value.details()
    wait_for(http_stack.idle, 10, "no KV blocks held after the refusal")
