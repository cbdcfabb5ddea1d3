"""Stateless incremental detokenization: new token ids plus a small window of earlier ids -> a text delta.

The prefix/read-offset method: decode the window up to read_offset (text already emitted) and the
whole window plus the new ids; the difference is the new text, emitted only when it does not end in
an incomplete UTF-8 character (U+FFFD). When it does, the text up to the last id boundary that ends a
whole character is emitted, so a multi-id step that ends inside a character still yields the
characters before it. Decoding in context keeps words that span tokens and multi-byte characters
whole. After an emission the window keeps only the ids from the old read offset on, so it stays a few
ids long; a long run of undecodable ids is flushed with replacement characters rather than held
forever. Stop strings are cut by stops.py, which names the one that ended the text. The caller
carries the state (window, read_offset, pending_text) between calls. This module must not know about
gRPC status codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from services.tokenizer.errors import InvalidArgument, TokenizerError
from services.tokenizer.stops import cut_at_stops

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from services.tokenizer.registry import TokenizerRegistry
    from strata.v1 import tokenizer_pb2

    DecodeMany = Callable[[Sequence[Sequence[int]]], list[str]]

# A UTF-8 character spans at most 4 byte tokens; more ids than this without any text is not a
# character still arriving but undecodable bytes, emitted as replacement characters.
MAX_HELD_IDS = 16
# The most ids one character's bytes can be split over (UTF-8 has at most 4 bytes per character).
MAX_CHARACTER_IDS = 4
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class DetokenizeStep:
    """One request's detokenization state plus this step's new ids."""

    window: Sequence[int]
    read_offset: int
    new_ids: Sequence[int]
    pending_text: str = ""
    stop: Sequence[str] = field(default_factory=tuple)
    final: bool = False


@dataclass(frozen=True)
class Detokenized:
    """Text to emit now and the state to send with the next step."""

    text: str
    window: list[int]
    read_offset: int
    pending_text: str
    stop_sequence: str = ""
    """The stop string that ended the text (stops.py); empty when none did."""
    pieces: Sequence[bytes] = ()
    """The bytes of each of the entry's piece_ids alone (for log probabilities)."""

    @property
    def stopped(self) -> bool:
        return bool(self.stop_sequence)


def detokenize_many(decode_many: DecodeMany, steps: Sequence[DetokenizeStep]) -> list[Detokenized]:
    """Detokenize steps of one tokenizer with a single batched decode; read offsets must be valid."""
    sequences = [[*step.window, *step.new_ids] for step in steps]
    emitted = [ids[: step.read_offset] for ids, step in zip(sequences, steps, strict=True)]
    texts = decode_many(emitted + sequences)
    prefixes, fulls = texts[: len(steps)], texts[len(steps) :]
    return [
        advance(decode_many, step, ids, prefix, full)
        for step, ids, prefix, full in zip(steps, sequences, prefixes, fulls, strict=True)
    ]


def detokenize(decode_many: DecodeMany, step: DetokenizeStep) -> Detokenized:
    """Detokenize one step."""
    return detokenize_many(decode_many, [step])[0]


def advance(
    decode_many: DecodeMany, step: DetokenizeStep, ids: list[int], prefix_text: str, full_text: str
) -> Detokenized:
    """The step's outcome, given the decoded text of ids[:read_offset] and of all ids."""
    read_offset = step.read_offset
    held = len(ids) - read_offset
    complete = len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT)
    # The ids may end inside a character while the ones before it complete some text: emit up to
    # the last character boundary rather than wait for a step that happens to end on one.
    boundary = None
    if not (complete or step.final) and held > 1:
        boundary = last_boundary(decode_many, ids, read_offset, prefix_text)
    if complete or step.final or (boundary is None and held > MAX_HELD_IDS):
        delta, window, next_offset = full_text[len(prefix_text) :], ids[read_offset:], held
    elif boundary is not None:
        end, text = boundary
        delta, window, next_offset = text[len(prefix_text) :], ids[read_offset:], end - read_offset
    else:
        delta, window, next_offset = "", ids, read_offset
    cut = cut_at_stops(step.pending_text, delta, step.stop, final=step.final)
    return Detokenized(cut.text, window, next_offset, cut.pending_text, cut.stop_sequence)


def last_boundary(
    decode_many: DecodeMany, ids: list[int], read_offset: int, prefix_text: str
) -> tuple[int, str] | None:
    """The largest end (past read_offset) at which ids decode to new, whole characters, with their text."""
    ends = range(len(ids) - 1, max(read_offset, len(ids) - 1 - MAX_CHARACTER_IDS), -1)
    texts = decode_many([ids[:end] for end in ends])
    for end, text in zip(ends, texts, strict=True):
        if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT):
            return end, text
    return None


def detokenize_entries(
    registry: TokenizerRegistry, entries: Sequence[tokenizer_pb2.DetokenizeEntry]
) -> list[Detokenized | TokenizerError]:
    """One outcome per entry, in order; the entries of each model share one batched decode."""
    outcomes: list[Detokenized | TokenizerError | None] = [None] * len(entries)
    groups: dict[str, list[tuple[int, DetokenizeStep]]] = {}
    for index, entry in enumerate(entries):
        try:
            model = registry.get(entry.model)
        except TokenizerError as error:
            outcomes[index] = error
            continue
        if entry.read_offset > len(entry.window):
            outcomes[index] = InvalidArgument(
                f"read_offset: {entry.read_offset} is past the end of the {len(entry.window)}-id window; "
                "send back the window and read_offset of the previous result"
            )
            continue
        step = DetokenizeStep(
            window=entry.window,
            read_offset=entry.read_offset,
            # Special and unknown ids decode to nothing; dropping them keeps the window short.
            new_ids=model.decodable(entry.new_ids),
            pending_text=entry.pending_text,
            stop=entry.stop,
            final=entry.final,
        )
        groups.setdefault(model.name, []).append((index, step))
    for name, items in groups.items():
        results = detokenize_many(registry.get(name).decode_batch, [step for _, step in items])
        model = registry.get(name)
        for (index, _), result in zip(items, results, strict=True):
            piece_ids = entries[index].piece_ids
            outcomes[index] = replace(result, pieces=model.pieces(piece_ids)) if piece_ids else result
    return [outcome for outcome in outcomes if outcome is not None]
