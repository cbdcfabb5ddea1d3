"""Log probabilities as the gateway hands them on: each token named by its text and bytes.

The worker sends token ids and log probabilities only; the tokenizer service returns each id's bytes
alone (DetokenizeEntry.piece_ids, in the same Detokenize call as the text), and this module writes
them into the entries: `token_bytes` exact, `token` as UTF-8 text with a partial character as U+FFFD.
It must not do I/O nor decide which requests get log probabilities (the request's sampling does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata.v1 import common_pb2

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence


def piece_ids(positions: Iterable[common_pb2.PositionLogprobs]) -> list[int]:
    """Every id the entries name (each chosen token, then its alternatives), in the order `named` reads."""
    ids: list[int] = []
    for position in positions:
        ids.append(position.chosen.token_id)
        ids.extend(top.token_id for top in position.top)
    return ids


def named(
    positions: Sequence[common_pb2.PositionLogprobs], pieces: Iterator[bytes]
) -> list[common_pb2.PositionLogprobs]:
    """Copies of `positions` with each token's text and bytes taken from `pieces`, in piece_ids' order."""
    out: list[common_pb2.PositionLogprobs] = []
    for position in positions:
        copy = common_pb2.PositionLogprobs()
        copy.CopyFrom(position)
        for token in (copy.chosen, *copy.top):
            raw = next(pieces, b"")
            token.token_bytes = raw
            token.token = raw.decode("utf-8", errors="replace")
        out.append(copy)
    return out
