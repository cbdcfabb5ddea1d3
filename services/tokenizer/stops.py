"""Stop strings over streamed text: cut exactly where the first one begins, never emit part of one.

Text arrives in deltas. Any tail of the text so far that could still grow into a stop string is held
back (the caller keeps it as pending text and sends it again with the next delta), so emitted text
never holds any part of a stop string, and a stop string split across steps is found where it begins.
The cut names the stop string that ended the text (the one whose occurrence begins earliest; on a tie,
the first in the list), so that an API can report which one matched. Pure functions over strings:
this module must not decode tokens nor know about requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass(frozen=True)
class StopCut:
    """What to emit now, what to hold back, and which stop string ended the text, if one did."""

    text: str
    pending_text: str
    stop_sequence: str = ""
    """The stop string that ended the text; empty when none did."""


def cut_at_stops(pending_text: str, delta: str, stop: Sequence[str], *, final: bool) -> StopCut:
    """Split pending_text + delta into text to emit now and text to hold back.

    A stop string found anywhere cuts the text where the earliest one begins and is named in
    stop_sequence (on a tie, the first of `stop`). Otherwise the longest tail that is a proper prefix
    of some stop string is held back, unless `final`: then it is released, since it can no longer
    become a stop string.
    """
    text = pending_text + delta
    stops = [s for s in stop if s]
    if not stops:
        return StopCut(text, "")
    found = [(index, s) for s in stops if (index := text.find(s)) >= 0]
    if found:
        # min() keeps the first of equal indexes, so a tie goes to the stop string listed first.
        index, matched = min(found, key=lambda pair: pair[0])
        return StopCut(text[:index], "", matched)
    if final:
        return StopCut(text, "")
    held = held_length(text, stops)
    return StopCut(text[: len(text) - held], text[len(text) - held :])


def held_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `stops`."""
    longest = min(len(text), max(len(s) for s in stops) - 1)
    for length in range(longest, 0, -1):
        tail = text[-length:]
        if any(len(s) > length and s.startswith(tail) for s in stops):
            return length
    return 0
