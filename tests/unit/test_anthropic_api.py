"""The Messages API's own mapping, without a stack: each pipeline failure's Anthropic status and error
type (an overloaded route is 529, which the stack tests cannot provoke on demand), and a conversation's
blocks read as the chat turns the pipeline runs."""

from __future__ import annotations

import json

import pytest

from gateway.admission import Refused
from gateway.anthropic_errors import OVERLOADED, anthropic_error
from gateway.anthropic_schema import MessagesRequest
from gateway.errors import DeadlineExceeded, GatewayError, InvalidArgument, NotFound, Unavailable
from gateway.openai_errors import HttpError, from_gateway, unauthenticated
from strata.status import QuotaExceeded


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (Refused("model 'm' is overloaded: forecast 3 s", 2.5, "ttft_slo"), OVERLOADED, "overloaded_error"),
        (Unavailable("no worker is ready for model 'm'"), OVERLOADED, "overloaded_error"),
        (QuotaExceeded("tenant 't' is over its quota", 1.0, "tenant:t", "max=1"), 429, "rate_limit_error"),
        (InvalidArgument("sampling.top_p: 2 must be in (0, 1]"), 400, "invalid_request_error"),
        (NotFound("model 'x' is not served here"), 404, "not_found_error"),
        (DeadlineExceeded("the deadline passed"), 504, "timeout_error"),
    ],
)
def test_a_pipeline_failure_has_anthropics_status_and_type(
    error: GatewayError, status: int, kind: str
) -> None:
    answer = anthropic_error(from_gateway(error))
    assert (answer.status, answer.type) == (status, kind)
    assert answer.body() == {"type": "error", "error": {"type": kind, "message": answer.message}}
    if status in (429, OVERLOADED) and not isinstance(error, Unavailable):
        assert int(answer.headers["retry-after"]) >= 1


def test_the_door_refusals_speak_of_anthropics_header_and_unknown_statuses_are_api_errors() -> None:
    assert "x-api-key" in anthropic_error(unauthenticated()).message
    assert anthropic_error(HttpError(418, "teapot")).status == 500
    assert anthropic_error(HttpError(418, "teapot")).type == "api_error"


def test_blocks_become_the_chat_turns_the_pipeline_runs() -> None:
    """System first; an assistant's text and tool_use one turn with its call (its thinking block left
    out); the user's tool_result a tool turn answering that call, before the user's text; any, tool
    and none choices."""
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "The user wants Paris.", "signature": ""},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "c1", "name": "w", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "c1", "content": "21 C"},
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
            "tools": [{"name": "w", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "stop_sequences": ["END"],
            "top_k": 5,
        }
    )
    chat = body.as_chat()
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "Weather?"),
        ("assistant", "Let me look."),
        ("tool", "21 C"),
        ("user", "Thanks"),
    ]
    (call,) = chat.messages[2].tool_calls or []
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "c1",
        "w",
        {"city": "Paris"},
    )
    assert chat.messages[3].tool_call_id == "c1"
    assert chat.tool_choice == "required" and chat.stop == ["END"] and chat.top_k == 5
    assert chat.max_tokens == 8 and chat.temperature == 1.0
