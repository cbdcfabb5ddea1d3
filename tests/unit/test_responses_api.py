"""The Responses API's parts without a stack: input items read as the chat turns the pipeline runs, the
per-tenant store's time limit, size cap and isolation (with a clock of the test's own), the order of a
stream's events for text and for calls, and pipeline errors named in this API's fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.errors import InvalidArgument
from gateway.openai_schema import ChatMessage
from gateway.response_store import ResponseStore
from gateway.responses_api import _error
from gateway.responses_output import ResponseEvents, ResponseShape, answer_turn
from gateway.responses_schema import ResponsesRequest
from gateway.tool_stream import ToolStream
from strata.v1 import common_pb2, gateway_pb2


def test_items_become_the_chat_turns_the_pipeline_runs() -> None:
    """Instructions first; an easy message without `type`; an earlier answer's output_text; a call
    joining the assistant turn before it; a call with no turn before it its own assistant turn; an
    output a tool turn answering its call; a reasoning item left out; the history of a continuation
    before the input."""
    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather?"},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
                },
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "?"}],
                },
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
                {"role": "developer", "content": [{"type": "input_text", "text": "Now Rome."}]},
            ],
        }
    )
    history = [ChatMessage(role="user", content="Earlier."), ChatMessage(role="assistant", content="Yes.")]
    turns = body.as_chat(history).messages
    assert [(t.role, t.text()) for t in turns] == [
        ("system", "Be brief."),
        ("user", "Earlier."),
        ("assistant", "Yes."),
        ("user", "Weather?"),
        ("assistant", "Let me look."),
        ("tool", "21 C"),
        ("assistant", ""),
        ("developer", "Now Rome."),
    ]
    assert [c.id for c in turns[4].tool_calls or ()] == ["c1"] and turns[5].tool_call_id == "c1"
    assert [c.function.name for c in turns[6].tool_calls or ()] == ["w"]
    assert body.input_turns()[0].role == "user", "instructions stay out of the stored turns"


def test_options_map_onto_the_chat_request() -> None:
    body = ResponsesRequest.model_validate(
        {
            "input": "hi",
            "max_output_tokens": 7,
            "truncation": "auto",
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "w"},
            "text": {"format": {"type": "json_object"}},
        }
    )
    chat = body.as_chat([])
    assert chat.token_limit() == ("max_completion_tokens", 7) and chat.truncation == "left"
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)
    assert chat.tool_choice.function.name == "w"
    assert chat.response_format is not None and chat.response_format.type == "json_object"


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"input": [{"type": "web_search_call", "id": "w", "status": "completed"}]}, "input"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_it(body: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError) as refused:
        ResponsesRequest.model_validate(body)
    assert named in str(refused.value)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _turns(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


def test_the_store_forgets_after_its_time_limit_and_keeps_tenants_apart() -> None:
    clock = Clock()
    store = ResponseStore(ttl_s=10.0, max_bytes=1 << 20, clock=clock)
    assert store.put("a", {"id": "resp_1"}, _turns("one"))
    assert store.get("a", "resp_1") is not None and store.get("b", "resp_1") is None
    assert not store.delete("b", "resp_1"), "another tenant cannot delete it"
    clock.now = 9.9
    assert store.get("a", "resp_1") is not None
    clock.now = 10.0
    assert store.get("a", "resp_1") is None and store.bytes_held("a") == 0


def test_the_store_evicts_a_tenants_oldest_past_its_size_cap() -> None:
    store = ResponseStore(ttl_s=100.0, max_bytes=1000, clock=Clock())
    for index in range(6):
        assert store.put("a", {"id": f"resp_{index}", "text": "x" * 200}, _turns("q"))
        store.put("b", {"id": f"resp_{index}"}, _turns("q"))
    kept = [index for index in range(6) if store.get("a", f"resp_{index}") is not None]
    assert kept == list(range(6 - len(kept), 6)) and 0 < len(kept) < 6, "the newest are kept"
    assert store.bytes_held("a") <= 1000
    assert all(store.get("b", f"resp_{index}") is not None for index in range(6)), "b's budget is its own"
    assert not store.put("a", {"id": "resp_big", "text": "x" * 2000}, _turns("q")), "larger than the cap"
    assert store.get("a", "resp_5") is not None, "a refused put evicts nothing"
    assert store.delete("a", "resp_5") and store.get("a", "resp_5") is None


def _final(text: str = "", calls: int = 0, length: bool = False) -> gateway_pb2.GenerateResponse:
    final = gateway_pb2.GenerateResponse(request_id="r1", model="m", text=text)
    final.finish_reason = common_pb2.FINISH_REASON_LENGTH if length else common_pb2.FINISH_REASON_STOP
    final.usage.input_tokens, final.usage.cached_input_tokens, final.usage.output_tokens = 10, 4, 3
    for index in range(calls):
        final.tool_calls.add(id=f"call_{index}", name="w", arguments_json='{"city": "Paris"}')
    return final


def test_text_events_open_the_message_once_and_end_with_the_whole_response() -> None:
    events = ResponseEvents(ResponseShape(ResponsesRequest.model_validate({"input": "x"}), "r1", "m"))
    kinds = [kind for kind, _ in events.opening() + events.pieces(["Hel", "lo"])]
    ending = events.closing(_final("Hello", length=True))
    kinds += [kind for kind, _ in ending]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    whole = ending[-1][1]["response"]
    assert whole["status"] == "incomplete" and whole["output"][0]["content"][0]["text"] == "Hello"
    assert whole["usage"]["input_tokens_details"] == {"cached_tokens": 4}
    assert [payload["sequence_number"] for _, payload in ending] == list(range(6, 10))


def test_each_call_is_an_item_with_its_arguments_and_the_answer_turn_holds_them() -> None:
    events = ResponseEvents(ResponseShape(ResponsesRequest.model_validate({"input": "x"}), "r1", "m"))
    events.opening()
    final = _final(calls=2)
    held = ToolStream(gateway_pb2.GenerateRequest(tools=[gateway_pb2.Tool(name="w")]))
    ending = events.pieces(held.finish("", final)) + events.closing(final)
    assert [kind for kind, _ in ending].count("response.function_call_arguments.delta") == 2
    assert ending[-1][0] == "response.completed"
    items = ending[-1][1]["response"]["output"]
    assert [(item["type"], item["call_id"]) for item in items] == [
        ("function_call", "call_0"),
        ("function_call", "call_1"),
    ]
    added = [payload["output_index"] for kind, payload in ending if kind == "response.output_item.added"]
    assert added == [0, 1]
    turn = answer_turn(final)
    assert turn.content is None and [c.id for c in turn.tool_calls or ()] == ["call_0", "call_1"]


def test_a_pipeline_error_names_the_field_as_this_api_does() -> None:
    too_many = _error(InvalidArgument("sampling.max_new_tokens: 9000 is over the limit 4096"))
    assert too_many.status == 400 and too_many.param == "max_output_tokens"
    assert "max_output_tokens" in too_many.message
    assert _error(InvalidArgument("messages[2].content: too long")).param == "input"
    assert _error(InvalidArgument("sampling.constraint: bad schema")).param == "text.format"


def test_a_call_cut_inside_keeps_the_item_it_streamed() -> None:
    """A call announced and then cut by the token limit (no call parses): the response is incomplete
    and its output is the call's item as streamed, not a message of the call's raw text."""
    events = ResponseEvents(ResponseShape(ResponsesRequest.model_validate({"input": "x"}), "r1", "m"))
    request = gateway_pb2.GenerateRequest(request_id="r1", tools=[gateway_pb2.Tool(name="w")])
    held = ToolStream(request)
    text = '<tool_call>{"name": "w", "arguments": {"city": "Pa'
    final = _final(text, length=True)
    ending = events.pieces(held.take(text)) + events.pieces(held.finish("", final)) + events.closing(final)
    kinds = [kind for kind, _ in ending]
    assert "response.output_text.delta" not in kinds and "response.content_part.added" not in kinds
    assert kinds[-1] == "response.incomplete"
    (item,) = ending[-1][1]["response"]["output"]
    assert (item["type"], item["name"], item["status"], item["arguments"]) == (
        "function_call",
        "w",
        "incomplete",
        '{"city": "Pa',
    )
