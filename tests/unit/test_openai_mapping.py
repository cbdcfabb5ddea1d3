"""The HTTP APIs' bodies mapped onto the gRPC request: the sampling scalars the body takes from the
table, Strata's `speculate` extension field, and each API's way to ask for one tool call at most."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.anthropic_schema import MessagesRequest
from gateway.openai_mapping import to_generate_request
from gateway.openai_schema import TABLE_FIELDS, ChatCompletionRequest
from gateway.responses_schema import ResponsesRequest
from gateway.settings import GatewaySettings
from strata.sampling import SamplingOptions, option_type

if TYPE_CHECKING:
    from strata.v1 import common_pb2

SETTINGS = GatewaySettings.build({"tokenizer_address": "t:1", "routes": [{"model": "m", "workers": ["h:1"]}]})


def _sampling_of(body: dict[str, object]) -> common_pb2.SamplingParams:
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    )
    return to_generate_request(chat, SETTINGS, lambda _: None).sampling


def test_each_table_scalar_sent_in_the_body_reaches_the_request_and_one_not_sent_stays_unset() -> None:
    """The body's fields made from the table: each of the client's scalars named as the proto names
    it is one, typed as the client types it, and copied by name; absent, it is unset (the gateway's
    default), except temperature, whose HTTP default is OpenAI's 1."""
    assert set(TABLE_FIELDS) == set(SamplingOptions.__annotations__) - {"max_new_tokens"}
    set_when_not_sent = {field.name for field, _ in _sampling_of({}).ListFields()}
    assert set_when_not_sent & set(TABLE_FIELDS) == {"temperature"}
    for name in TABLE_FIELDS:
        value = option_type(name)(1)
        sent = _sampling_of({name: value})
        assert getattr(sent, name) == value and name in {field.name for field, _ in sent.ListFields()}


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
