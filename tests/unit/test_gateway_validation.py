"""Gateway request validation: every bad field is refused with a message naming it; defaults are filled."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.errors import InvalidArgument, NotFound
from gateway.settings import GatewaySettings
from gateway.validation import validate
from strata.v1 import common_pb2, gateway_pb2

SETTINGS = GatewaySettings.build(
    {
        "tokenizer_address": "127.0.0.1:1",
        "routes": [
            {"model": "tiny", "workers": ["127.0.0.1:2"]},
            {"model": "big", "workers": ["127.0.0.1:3"]},
        ],
        "default_max_new_tokens": 32,
    }
)


def _limit(model: str) -> int | None:
    return {"tiny": 256}.get(model)


def _request(**fields: Any) -> gateway_pb2.GenerateRequest:
    sampling = fields.pop("sampling", {})
    base: dict[str, Any] = {"prompt": "Hello"}
    base.update(fields)
    return gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling), **base)


BAD: list[tuple[str, dict[str, Any]]] = [
    ("prompt: set exactly one of prompt and messages", {"prompt": ""}),
    (
        "prompt: set exactly one of prompt and messages",
        {"messages": [common_pb2.ChatMessage(role="user", content="hi")]},
    ),
    (
        "messages[1].role",
        {"prompt": "", "messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
    ),
    ("messages[0].content", {"prompt": "", "messages": [{"role": "user", "content": ""}]}),
    ("sampling.max_new_tokens", {"sampling": {"max_new_tokens": -1}}),
    ("sampling.temperature", {"sampling": {"temperature": -0.5}}),
    ("sampling.temperature", {"sampling": {"temperature": math.nan}}),
    ("sampling.top_p", {"sampling": {"top_p": 0.0}}),
    ("sampling.top_p", {"sampling": {"top_p": 1.5}}),
    ("sampling.top_k", {"sampling": {"top_k": -1}}),
    ("sampling.repetition_penalty", {"sampling": {"repetition_penalty": 0.0}}),
    ("sampling.no_repeat_ngram_size", {"sampling": {"no_repeat_ngram_size": -2}}),
    ("sampling.seed", {"sampling": {"seed": 2**63}}),
    ("sampling.presence_penalty", {"sampling": {"presence_penalty": 2.5}}),
    ("sampling.frequency_penalty", {"sampling": {"frequency_penalty": math.inf}}),
    ("sampling.min_p", {"sampling": {"min_p": 1.01}}),
    ("sampling.logit_bias", {"sampling": {"logit_bias": {4: -101.0}}}),
    ("sampling.logit_bias", {"sampling": {"logit_bias": {i: 1.0 for i in range(301)}}}),
    ("sampling.stop_token_ids", {"sampling": {"stop_token_ids": list(range(33))}}),
    ("sampling.min_tokens", {"sampling": {"min_tokens": 65}}),
    ("sampling.top_logprobs", {"sampling": {"top_logprobs": 3}}),
    ("sampling.top_logprobs", {"sampling": {"logprobs": True, "top_logprobs": 21}}),
    ("sampling.prompt_logprobs", {"sampling": {"prompt_logprobs": 21}}),
    ("sampling.stop", {"sampling": {"stop": ["x"] * 9}}),
    ("sampling.stop[1]", {"sampling": {"stop": ["ok", ""]}}),
    ("sampling.stop[0]", {"sampling": {"stop": ["é" * 33]}}),
    ("request_id", {"request_id": "r" * 129}),
    ("request_id", {"request_id": "bad\nid"}),
    ("truncation", {"truncation": 9}),
    ("sampling.max_new_tokens", {"sampling": {"max_new_tokens": 256}}),
]


@pytest.mark.parametrize(("field", "fields"), BAD, ids=[f"{i}-{b[0][:24]}" for i, b in enumerate(BAD)])
def test_invalid_field_is_named(field: str, fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate(_request(**fields), SETTINGS, _limit, {})
    assert info.value.message.startswith(field), info.value.message


def test_context_limit_message_names_the_model_limit() -> None:
    with pytest.raises(InvalidArgument, match=r"context of 256 tokens; ask for at most 255"):
        validate(_request(sampling={"max_new_tokens": 300}), SETTINGS, _limit, {})


def test_unknown_model_is_not_found_and_names_known_models() -> None:
    with pytest.raises(NotFound, match=r"'nope'.*tiny, big"):
        validate(_request(model="nope"), SETTINGS, _limit, {})


def test_defaults_are_filled() -> None:
    valid = validate(_request(), SETTINGS, _limit, {})
    assert valid.model == "tiny"
    assert valid.sampling.max_new_tokens == 32
    assert len(valid.request_id) == 32 and int(valid.request_id, 16) >= 0
    # The caller's request is not modified.
    assert _request().sampling.max_new_tokens == 0


def test_valid_request_keeps_fields() -> None:
    request = _request(
        model="big",
        request_id="my id-1",
        sampling={"max_new_tokens": 5, "top_p": 0.5, "stop": ["\n\n", "é" * 32], "repetition_penalty": 1.1},
        messages=[],
    )
    valid = validate(request, SETTINGS, _limit, {})  # big has no known limit yet: no context check
    assert (valid.model, valid.request_id) == ("big", "my id-1")
    assert valid.stop == ("\n\n", "é" * 32)
    assert valid.sampling.max_new_tokens == 5
