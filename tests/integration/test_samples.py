"""n samples of one prompt through the whole stack: reproducible seeds (sample 0 is the n = 1 request,
sample i the n = 1 request with seed mix(seed, i)), the prompt prefilled once and shared through the
prefix cache, per-sample streams and finals (each naming the stop string that ended it), cancellation
of every sample, validation, and the openai SDK reading `choices[i]`.

One real stack per module (conftest.py's http_stack: tokenizer service, worker, gateway with its HTTP
API, the tiny model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import openai
import pytest

from gateway.samples import sample_seed
from strata.client import StrataClient, build_request
from strata.v1 import common_pb2, gateway_pb2_grpc
from tests.integration.http_harness import KEY, MODEL, HttpStack
from tests.polling import wait_for

if TYPE_CHECKING:
    from collections.abc import Iterator

    from openai.types.chat import ChatCompletionMessageParam

    from strata.client import GenerateOptions


def sampled(seed: int, n: int = 1) -> GenerateOptions:
    """Sampling options of the tests: temperature 1, top_p 0.95, 10 tokens, EOS ignored."""
    return {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 10, "ignore_eos": True, "seed": seed, "n": n}


LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 8


@pytest.fixture(scope="module")
def client(http_stack: HttpStack) -> Iterator[StrataClient]:
    with StrataClient(http_stack.gateway_address, api_key=KEY) as strata:
        yield strata


def test_sample_seeds_are_mixed_and_sample_zero_keeps_the_seed() -> None:
    assert sample_seed(42, 0) == 42
    seeds = {sample_seed(42, i) for i in range(1, 17)}
    assert len(seeds) == 16 and 42 not in seeds and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(2**63 - 1, 16) < 2**63


def test_each_sample_is_the_single_request_with_its_own_seed(client: StrataClient) -> None:
    reply = client.generate("hello world", **sampled(7, 3))
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == reply.finish_reason for c in reply.choices)
    assert reply.usage.output_tokens == 30
    assert list(reply.token_ids) == list(reply.choices[0].token_ids)
    for choice in reply.choices:
        alone = client.generate("hello world", **sampled(sample_seed(7, choice.index)))
        assert list(alone.token_ids) == list(choice.token_ids)
    assert len({tuple(c.token_ids) for c in reply.choices}) == 3, "sampled samples should differ"


def test_greedy_samples_are_identical(client: StrataClient) -> None:
    reply = client.generate("hello world", n=4, max_new_tokens=6)
    assert len(reply.choices) == 4 and len({tuple(c.token_ids) for c in reply.choices}) == 1


def test_each_choice_names_the_stop_string_that_ended_it(client: StrataClient) -> None:
    alone = client.generate("hello world", max_new_tokens=10, ignore_eos=True)
    stop = alone.text[len(alone.text) // 2 :][:3]
    assert stop.strip(), f"pick another stop string from {alone.text!r}"
    reply = client.generate("hello world", n=2, max_new_tokens=10, ignore_eos=True, stop=["\x07never", stop])
    stopped = (common_pb2.FINISH_REASON_STOP, stop)
    assert [(c.finish_reason, c.stop_sequence) for c in reply.choices] == [stopped, stopped]
    assert (reply.finish_reason, reply.stop_sequence) == stopped
    assert alone.stop_sequence == ""


def test_the_prompt_is_prefilled_once_and_shared(client: StrataClient, http_stack: HttpStack) -> None:
    before = http_stack.worker_stats()
    reply = client.generate(LONG_PROMPT, **sampled(1, 3))
    after = http_stack.worker_stats()
    full_blocks = (reply.usage.input_tokens - 1) // 16
    assert full_blocks >= 3
    # Samples 1 and 2 found every full block of the prompt that sample 0 computed.
    hits = after.prefix_cache_hit_blocks - before.prefix_cache_hit_blocks
    assert hits >= 2 * full_blocks
    assert all(c.usage.cached_input_tokens >= 16 * full_blocks for c in reply.choices[1:])


def test_stream_indexes_every_message_and_ends_with_the_whole_final(client: StrataClient) -> None:
    messages = list(client.send_stream(build_request("hello world", **sampled(5, 3))))
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finals = {}
    for message in messages[:-1]:
        tokens[message.index].extend(message.token_ids)
        if message.HasField("final"):
            finals[message.index] = message.final
    assert sorted(finals) == [0, 1, 2]
    last = messages[-1].final
    assert [list(c.token_ids) for c in last.choices] == [tokens[0], tokens[1], tokens[2]]
    assert all(list(finals[i].token_ids) == tokens[i] for i in range(3))


def test_cancelling_cancels_every_sample(http_stack: HttpStack) -> None:
    wait_for(http_stack.idle, 30, "the worker went idle")
    channel = grpc.insecure_channel(http_stack.gateway_address)
    try:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = build_request("cancel us", n=3, max_new_tokens=200, ignore_eos=True, temperature=1.0)
        call = stub.GenerateStream(request, metadata=[("authorization", f"Bearer {KEY}")], timeout=120)
        seen: set[int] = set()
        for message in call:
            seen.add(message.index)
            if len(seen) == 3:
                break
        assert http_stack.worker_stats().open_requests >= 2
        call.cancel()
        wait_for(http_stack.idle, 10, "every sample's KV blocks freed after the cancel")
    finally:
        channel.close()


def test_too_many_samples_is_invalid_argument(client: StrataClient) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        client.generate("hello", n=17)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("n: 17")


def test_sdk_reads_every_choice_streamed_and_not(http_stack: HttpStack) -> None:
    sdk = openai.OpenAI(base_url=http_stack.base_url, api_key=KEY, max_retries=0, timeout=60)
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
    whole = sdk.chat.completions.create(
        model=MODEL,
        messages=chat,
        max_tokens=5,
        n=3,
        seed=11,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert all(c.logprobs is not None and len(c.logprobs.content or []) == 5 for c in whole.choices)
    assert whole.usage is not None and whole.usage.completion_tokens == 15
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=chat,
        max_tokens=5,
        n=3,
        seed=11,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
