"""The HTTP APIs' bodies mapped onto the gRPC request: Strata's `speculate` extension field, and each
API's way to ask for one tool call at most."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.anthropic_schema import MessagesRequest
from gateway.openai_mapping import to_generate_request
from gateway.openai_schema import ChatCompletionRequest
from gateway.responses_schema import ResponsesRequest
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


def test_each_apis_no_parallel_calls_field_asks_for_one_call() -> None:
    """Chat's and Responses' parallel_tool_calls false, Anthropic's disable_parallel_tool_use true:
    the gRPC request's tool_choice.single_call; unset or true leaves several calls allowed."""
    tools = [{"type": "function", "function": {"name": "w"}}]
    messages = [{"role": "user", "content": "hi"}]

    def single(chat: ChatCompletionRequest) -> bool:
        return to_generate_request(chat, SETTINGS, lambda _: None).tool_choice.single_call

    def chat_of(**body: object) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(
            {"model": "m", "messages": messages, "tools": tools, **body}
        )

    assert single(chat_of(parallel_tool_calls=False))
    assert not single(chat_of(parallel_tool_calls=True)) and not single(chat_of())
    responses = {"input": "hi", "tools": [{"type": "function", "name": "w"}]}
    assert single(ResponsesRequest.model_validate({**responses, "parallel_tool_calls": False}).as_chat([]))
    assert not single(ResponsesRequest.model_validate(responses).as_chat([]))
    anthropic = {
        "model": "m",
        "max_tokens": 4,
        "messages": messages,
        "tools": [{"name": "w", "input_schema": {}}],
    }
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    assert single(MessagesRequest.model_validate({**anthropic, "tool_choice": choice}).as_chat())
    assert not single(MessagesRequest.model_validate(anthropic).as_chat())
