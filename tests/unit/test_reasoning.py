"""A thinking model's answer split into reasoning and answer, as a stream and whole, and the reasoning as
the Messages and Responses APIs stream it."""

from __future__ import annotations

import pytest

from gateway.anthropic_messages import _Blocks, message
from gateway.reasoning import ReasoningSplit
from gateway.responses_output import ResponseEvents, ResponseShape
from gateway.responses_schema import ResponsesRequest
from strata.v1 import common_pb2, gateway_pb2

TEXT = " <think>Paris is in France; </thi and more</think>\n\nIt is sunny."


def _streamed(text: str, size: int, enabled: bool = True) -> tuple[str, str]:
    split = ReasoningSplit(enabled)
    parts = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    reasoning, answer = "", ""
    for part in parts[:-1]:
        r, a = split.take(part)
        reasoning, answer = reasoning + r, answer + a
    r, a = split.finish(parts[-1])
    return reasoning + r, answer + a


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, len(TEXT)])
def test_the_split_is_the_same_however_the_text_is_cut(size: int) -> None:
    assert _streamed(TEXT, size) == ("Paris is in France; </thi and more", "It is sunny.")
    assert ReasoningSplit.split(TEXT, True) == _streamed(TEXT, size)


@pytest.mark.parametrize(
    ("text", "enabled", "expected"),
    [
        (TEXT, False, ("", TEXT)),
        ("It is <think>sunny</think>", True, ("", "It is <think>sunny</think>")),
        ("<think>unfinished", True, ("unfinished", "")),
        ("<thi", True, ("", "<thi")),
        ("  ", True, ("", "  ")),
        ("<think></think>answer", True, ("", "answer")),
    ],
)
def test_what_is_reasoning_and_what_is_answer(text: str, enabled: bool, expected: tuple[str, str]) -> None:
    """Off for a model without think tokens; only an answer that opens with the tag reasons; an
    unclosed reasoning stays reasoning; an unfinished tag at the end is answer."""
    assert ReasoningSplit.split(text, enabled) == expected
    assert _streamed(text, 1, enabled) == expected


def _final(text: str) -> gateway_pb2.GenerateResponse:
    final = gateway_pb2.GenerateResponse(request_id="r1", model="m", text=text)
    final.finish_reason = common_pb2.FINISH_REASON_STOP
    return final


def test_messages_put_the_reasoning_in_a_thinking_block_first() -> None:
    whole = message(_final(TEXT), thinks=True)
    assert [block["type"] for block in whole["content"]] == ["thinking", "text"]
    assert whole["content"][1]["text"] == "It is sunny."
    blocks = _Blocks()
    events = (
        blocks.thinking("Paris")
        + blocks.thinking(" is")
        + blocks.events(["It is"])
        + blocks.closing(_final(""))
    )
    starts = [p["content_block"]["type"] for kind, p in events if kind == "content_block_start"]
    deltas = [p["delta"]["type"] for kind, p in events if kind == "content_block_delta"]
    stops = [p["index"] for kind, p in events if kind == "content_block_stop"]
    assert starts == ["thinking", "text"] and deltas == ["thinking_delta", "thinking_delta", "text_delta"]
    assert stops == [0, 1], "the thinking block ends before the text block starts"


def test_responses_put_a_reasoning_item_before_the_message() -> None:
    shape = ResponseShape(ResponsesRequest.model_validate({"input": "x"}), "r1", "m", thinks=True)
    whole = shape.finished(_final(TEXT))
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [
        {"type": "reasoning_text", "text": "Paris is in France; </thi and more"}
    ]
    built = ResponseEvents(shape)
    events = (
        built.opening()
        + built.reasoning("Paris")
        + built.pieces(["It is sunny."])
        + built.closing(_final(TEXT))
    )
    kinds = [(kind, payload.get("output_index")) for kind, payload in events]
    assert kinds[2:6] == [
        ("response.output_item.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.output_item.done", 0),
    ]
    assert ("response.output_text.delta", 1) in kinds and kinds[-1] == ("response.completed", None)
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
