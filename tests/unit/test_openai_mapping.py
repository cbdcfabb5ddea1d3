"""The HTTP API's body mapped onto the gRPC request: Strata's `speculate` extension field."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.openai_mapping import to_generate_request
from gateway.openai_schema import ChatCompletionRequest
from gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from strata.v1 import common_pb2

SETTINGS = GatewaySettings.build({"tokenizer_address": "t:1", "routes": [{"model": "m", "workers": ["h:1"]}]})


def _sampling_of(body: dict[str, object]) -> common_pb2.SamplingParams:
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    )
    return to_generate_request(chat, SETTINGS, lambda _: None).sampling


def test_speculate_false_keeps_the_request_out_of_speculative_decoding() -> None:
    assert _sampling_of({"speculate": False}).no_speculation
    assert not _sampling_of({}).no_speculation
