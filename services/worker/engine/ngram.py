"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of a sequence's tail.

Text that quotes or edits its input repeats it: once the last few tokens of prompt plus output have
appeared before, what followed them then is a good guess at what follows now. This module owns that
guess and nothing else; it needs no model and no state between steps. It must not decide how many
tokens are worth drafting (speculation.py does) nor touch a sequence.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

_WIDTH = array("I").itemsize


def ngram_proposal(tokens: Sequence[int], num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """Up to num_tokens tokens that followed the latest earlier occurrence of the longest tail of
    `tokens` (max_n tokens down to min_n) found elsewhere in it; [] when none occurs."""
    count = len(tokens)
    if num_tokens < 1 or count < min_n + 1:
        return []
    # One byte string searched by the C library's rfind rather than a Python loop: about 10 us for
    # a few thousand tokens; a hit at an offset that is not a token's first byte is skipped.
    data = array("I", tokens).tobytes()
    for n in range(min(max_n, count - 1), min_n - 1, -1):
        tail = data[len(data) - n * _WIDTH :]
        # The occurrence must end before the last token, so that at least one token follows it.
        end = (count - 1) * _WIDTH
        found = data.rfind(tail, 0, end)
        while found > 0 and found % _WIDTH:
            found = data.rfind(tail, 0, found + len(tail) - 1)
        if found >= 0:
            start = found // _WIDTH + n
            return list(tokens[start : start + num_tokens])
    return []
