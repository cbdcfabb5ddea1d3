"""A stream's text read as it comes into what each HTTP API streams: plain text, or tool calls announced
as soon as their name is written and their arguments sent in fragments as the model writes them.

`ToolStream.take` gets each chunk's new text and answers pieces: `str` for text to send now,
`CallStart` (the call's place, id and name), `CallArguments` (the next fragment of its arguments, as
the model wrote them) and `CallEnd` (its arguments whole). A request that may not call tools sends all
its text as it comes. One that must call (REQUIRED, NAMED) reads calls only; with AUTO the first
character that is not whitespace decides (text may not start with '<', a call must: the grammar of
tool_calls.py). `finish` takes the last chunk's text and the calls the final answer holds: a call the
stream could not follow as it came is sent whole, an open one is ended; an answer whose calls did not
parse (cut by the token limit) was text, sent then unless a call had already been announced. The
calls' ids are tool_calls.call_id's, so they match the final answer's. This module must not know an
API's shapes nor do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway import tool_calls as calls
from strata.v1 import gateway_pb2


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    index: int
    arguments: str
    """The call's arguments whole: its fragments joined."""


Piece = str | CallStart | CallArguments | CallEnd


class ToolStream:
    """One streamed answer's text, read into pieces."""

    def __init__(self, request: gateway_pb2.GenerateRequest) -> None:
        self._mode = calls.mode_of(request) if calls.calls_tools(request) else None
        self._request_id = request.request_id
        self._text_mode = self._mode is None
        self._calls_mode = self._mode in (
            gateway_pb2.TOOL_CHOICE_MODE_REQUIRED,
            gateway_pb2.TOOL_CHOICE_MODE_NAMED,
        )
        self._text = ""
        """All the text of a call answer (or the undecided start of an AUTO one)."""
        self._position = 0
        """Where the next unread part of `_text` begins."""
        self._started = 0
        """How many calls were announced (CallStart sent)."""
        self._arguments_at: int | None = None
        """Where the open call's arguments begin in `_text`; None between calls."""

    def take(self, text: str) -> list[Piece]:
        if self._text_mode:
            return [text] if text else []
        self._text += text
        if not self._calls_mode:
            start = self._text.lstrip()
            if not start:
                return []
            if not start.startswith("<"):
                self._text_mode = True
                held, self._text = self._text, ""
                return [held]
            self._calls_mode = True
        return self._read()

    def finish(self, text: str, final: gateway_pb2.GenerateResponse) -> list[Piece]:
        """The pieces of the last chunk's `text`, then what makes them agree with `final`'s calls."""
        pieces = self.take(text)
        if self._text_mode:
            return pieces
        if not final.tool_calls and not self._started:
            held, self._text = self._text, ""  # no call parsed: the answer was text
            return [*pieces, held] if held else pieces
        if self._arguments_at is not None:
            pieces.append(CallEnd(self._started - 1, self._text[self._arguments_at :]))
            self._arguments_at = None
        for index in range(self._started, len(final.tool_calls)):
            call = final.tool_calls[index]
            pieces += [
                CallStart(index, call.id, call.name),
                CallArguments(index, call.arguments_json),
                CallEnd(index, call.arguments_json),
            ]
        self._started = max(self._started, len(final.tool_calls))
        return pieces

    def _read(self) -> list[Piece]:
        """The pieces of what came since the last read: heads, argument fragments, ends."""
        pieces: list[Piece] = []
        while True:
            if self._arguments_at is None:
                head = calls.CALL_HEAD.match(self._text, self._position)
                if head is None:
                    return pieces
                index = self._started
                self._started += 1
                pieces.append(CallStart(index, calls.call_id(self._request_id, index), head.group(1)))
                self._arguments_at = self._position = head.end()
            end = calls.value_end(self._text, self._arguments_at)
            upto = len(self._text) if end is None else end
            if upto > self._position:
                pieces.append(CallArguments(self._started - 1, self._text[self._position : upto]))
                self._position = upto
            tail = calls.CALL_TAIL.match(self._text, end) if end is not None else None
            if end is None or tail is None:
                return pieces
            pieces.append(CallEnd(self._started - 1, self._text[self._arguments_at : end]))
            self._arguments_at = None
            self._position = tail.end()
