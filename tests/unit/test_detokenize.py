"""Incremental detokenization and stop strings, as pure functions over real tokenizers.

The central property: however a token sequence is split into steps, the texts emitted (plus the final
flush) concatenate to the tokenizer's own decode of all ids, and no step emits half a character. The
tiny byte-level tokenizer splits emoji and Chinese characters over several ids; the real SmolLM2
tokenizer is checked the same way.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest

from services.tokenizer.detokenize import MAX_HELD_IDS, DetokenizeStep, detokenize, detokenize_entries
from services.tokenizer.errors import InvalidArgument, UnknownModel
from services.tokenizer.registry import ModelTokenizer, TokenizerRegistry, load_model
from services.tokenizer.stops import cut_at_stops, held_length
from strata.v1 import tokenizer_pb2
from tests.tiny_tokenizer import write_tiny_tokenizer

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

FRAGMENTS = [
    "Hello",
    " world",
    "你好，世界",
    "🙂🚀",
    " café",
    " naïve Zürich",
    "\n",
    " 12345",
    "✨",
    " The quick brown fox",
    "今天天气很好。",
    "  ",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    return load_model("tiny", write_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer")))


@pytest.fixture(scope="module")
def smol(real_model_dir: Path) -> ModelTokenizer:
    return load_model("smol", real_model_dir)


def encode(model: ModelTokenizer, text: str) -> list[int]:
    return model.encode_batch([text], add_special_tokens=False)[0]


def decode_all(model: ModelTokenizer, ids: Sequence[int]) -> str:
    return model.decode_batch([ids])[0]


def split(ids: list[int], rng: random.Random) -> list[list[int]]:
    """ids in random consecutive chunks, mostly of one id (a decode step), some longer, some empty."""
    chunks: list[list[int]] = []
    position = 0
    while position < len(ids):
        size = rng.choice([0, 1, 1, 1, 1, 2, 3, 5])
        chunks.append(ids[position : position + size])
        position += size
    return chunks


def stream(
    model: ModelTokenizer, chunks: list[list[int]], stop: Sequence[str] = ()
) -> tuple[list[str], bool, int]:
    """Feed chunks step by step, then a final flush; returns the step texts, stopped, the largest window.

    Without stop strings, each step must have emitted every whole character its ids completed.
    """
    texts, matched, largest = stream_stop(model, chunks, stop)
    return texts, bool(matched), largest


def stream_stop(
    model: ModelTokenizer, chunks: list[list[int]], stop: Sequence[str] = ()
) -> tuple[list[str], str, int]:
    """stream's steps, returning the stop string that ended the text ("" when none did) for stopped."""
    window: list[int] = []
    read_offset = 0
    pending = ""
    texts: list[str] = []
    seen: list[int] = []
    largest = 0
    for index, chunk in enumerate([*chunks, []]):
        final = index == len(chunks)
        result = detokenize(
            model.decode_batch, DetokenizeStep(window, read_offset, chunk, pending, stop, final=final)
        )
        texts.append(result.text)
        if result.stopped:
            return texts, result.stop_sequence, largest
        window, read_offset, pending = result.window, result.read_offset, result.pending_text
        seen += chunk
        largest = max(largest, len(window))
        assert 0 <= read_offset <= len(window)
        if not stop and not final:
            assert "".join(texts) == whole_characters(model, seen), (chunks, index)
    return texts, "", largest


def whole_characters(model: ModelTokenizer, ids: list[int]) -> str:
    """The text of the longest prefix of ids that does not end inside a character."""
    for end in range(len(ids), 0, -1):
        text = decode_all(model, ids[:end])
        if not text.endswith("\ufffd"):
            return text
    return ""


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))


def check_concatenation_property(model: ModelTokenizer, seed: int, trials: int) -> None:
    rng = random.Random(seed)
    for _ in range(trials):
        ids = encode(model, random_text(rng))
        chunks = split(ids, rng)
        texts, stopped, largest = stream(model, chunks)
        assert not stopped
        assert "".join(texts) == decode_all(model, ids), chunks
        assert all("\ufffd" not in text for text in texts), texts
        # The window holds the last emitted chunk plus ids still waiting for a whole character.
        assert largest <= max(map(len, chunks), default=0) + 4 + MAX_HELD_IDS


def test_multibyte_characters_span_several_ids(tiny: ModelTokenizer) -> None:
    ids = encode(tiny, "🙂")
    assert len(ids) > 1
    texts, _, _ = stream(tiny, [[i] for i in ids])
    assert texts[:-1] == [""] * (len(ids) - 1) + ["🙂"]


def test_any_split_concatenates_to_the_full_decode(tiny: ModelTokenizer) -> None:
    check_concatenation_property(tiny, seed=0, trials=300)


def test_one_id_per_step_concatenates_to_the_full_decode(tiny: ModelTokenizer) -> None:
    ids = encode(tiny, "你好，世界 🙂🚀 Hello world, café")
    texts, _, _ = stream(tiny, [[i] for i in ids])
    assert "".join(texts) == "你好，世界 🙂🚀 Hello world, café"
    assert all("\ufffd" not in text for text in texts)


def test_final_flushes_an_incomplete_character(tiny: ModelTokenizer) -> None:
    ids = encode(tiny, "a🙂")
    partial = ids[:-1]
    held = detokenize(tiny.decode_batch, DetokenizeStep([], 0, partial))
    assert held.text == "a"
    flushed = detokenize(
        tiny.decode_batch,
        DetokenizeStep(held.window, held.read_offset, [], held.pending_text, final=True),
    )
    assert flushed.text == "\ufffd"


def test_a_long_run_of_undecodable_bytes_is_flushed_not_held(tiny: ModelTokenizer) -> None:
    lead_byte = encode(tiny, "🙂")[0]
    window: list[int] = []
    read_offset = 0
    emitted = ""
    for _ in range(3 * MAX_HELD_IDS):
        result = detokenize(tiny.decode_batch, DetokenizeStep(window, read_offset, [lead_byte]))
        window, read_offset = result.window, result.read_offset
        emitted += result.text
        assert len(window) <= 2 * MAX_HELD_IDS + 2
    assert "\ufffd" in emitted


def test_special_and_unknown_ids_are_left_out(tiny: ModelTokenizer) -> None:
    registry = TokenizerRegistry({"tiny": tiny})
    rng = random.Random(7)
    eos = tiny.eos_token_ids[0]
    for _ in range(50):
        ids = encode(tiny, random_text(rng))
        for _ in range(rng.randint(1, 30)):
            ids.insert(rng.randint(0, len(ids)), rng.choice([eos, tiny.vocab_size + 5]))
        window: list[int] = []
        read_offset = 0
        texts = []
        chunks = split(ids, rng)
        for index, chunk in enumerate([*chunks, []]):
            entry = tokenizer_pb2.DetokenizeEntry(
                model="tiny",
                window=window,
                read_offset=read_offset,
                new_ids=chunk,
                final=index == len(chunks),
            )
            [result] = detokenize_entries(registry, [entry])
            assert not isinstance(result, Exception)
            texts.append(result.text)
            window, read_offset = result.window, result.read_offset
            assert eos not in window
        assert "".join(texts) == decode_all(tiny, ids)


def test_bad_entries_fail_alone(tiny: ModelTokenizer) -> None:
    registry = TokenizerRegistry({"tiny": tiny})
    ids = encode(tiny, "Hello")
    entries = [
        tokenizer_pb2.DetokenizeEntry(model="nope", new_ids=ids),
        tokenizer_pb2.DetokenizeEntry(model="tiny", window=ids[:1], read_offset=2, new_ids=ids),
        tokenizer_pb2.DetokenizeEntry(model="tiny", new_ids=ids, final=True),
    ]
    unknown, bad_offset, good = detokenize_entries(registry, entries)
    assert isinstance(unknown, UnknownModel)
    assert "'nope'" in unknown.message
    assert "tiny" in unknown.message
    assert isinstance(bad_offset, InvalidArgument)
    assert "read_offset" in bad_offset.message
    assert not isinstance(good, Exception)
    assert good.text == "Hello"


def test_stop_string_spanning_two_steps_is_cut_where_it_begins(tiny: ModelTokenizer) -> None:
    text = "Hello world, café"
    ids = encode(tiny, text)
    for cut in range(1, len(ids)):
        texts, matched, _ = stream_stop(tiny, [ids[:cut], ids[cut:]], stop=["café", "world"])
        assert matched == "world"
        assert "".join(texts) == "Hello "
        assert all("w" not in t for t in texts)


def test_earliest_of_several_stop_strings_wins(tiny: ModelTokenizer) -> None:
    ids = encode(tiny, "The quick brown fox jumps")
    texts, matched, _ = stream_stop(tiny, [[i] for i in ids], stop=["fox", "quick", "brown"])
    assert matched == "quick"
    assert "".join(texts) == "The "
    # All ids in one step: every stop string is in the text, and the earliest still wins.
    texts, matched, _ = stream_stop(tiny, [ids], stop=["jumps", "brown", "fox"])
    assert (matched, "".join(texts)) == ("brown", "The quick ")


def test_random_stop_strings_cut_the_text_exactly(tiny: ModelTokenizer) -> None:
    rng = random.Random(1)
    for _ in range(200):
        text = random_text(rng)
        ids = encode(tiny, text)
        full = decode_all(tiny, ids)
        start = rng.randrange(len(full))
        stop = [full[start : start + rng.randint(1, 4)], "never-there", "🙂🚀x"]
        index = min(i for s in stop if (i := full.find(s)) >= 0)
        # On a tie, the one listed first.
        matched_expected = next(s for s in stop if full.find(s) == index)
        texts, matched, _ = stream_stop(tiny, split(ids, rng), stop=stop)
        assert matched == matched_expected
        assert "".join(texts) == full[:index]
        assert all("\ufffd" not in t for t in texts)


def test_held_text_is_released_when_no_stop_string_completes(tiny: ModelTokenizer) -> None:
    ids = encode(tiny, "Hello wor")
    texts, stopped, _ = stream(tiny, [[i] for i in ids], stop=["world"])
    assert not stopped
    assert texts[-1].endswith("wor")
    assert "".join(texts) == "Hello wor"
    assert "w" not in "".join(texts[:-1])


def test_cut_at_stops_pure() -> None:
    assert cut_at_stops("", "abc", [], final=False).text == "abc"
    cut = cut_at_stops("ab", "cXde", ["Xd"], final=False)
    assert (cut.text, cut.pending_text, cut.stop_sequence) == ("abc", "", "Xd")
    cut = cut_at_stops("", "hello wo", ["world", "or"], final=False)
    assert (cut.text, cut.pending_text, cut.stop_sequence) == ("hello ", "wo", "")
    cut = cut_at_stops("wo", "", ["world"], final=True)
    assert (cut.text, cut.pending_text, cut.stop_sequence) == ("wo", "", "")
    # The earliest occurrence wins over the order of the list.
    cut = cut_at_stops("", "xxabcx", ["bc", "abc"], final=False)
    assert (cut.text, cut.stop_sequence) == ("xx", "abc")
    # Two stop strings beginning at the same index: the first in the list wins, either way round.
    assert cut_at_stops("", "say abcd", ["abc", "ab"], final=False).stop_sequence == "abc"
    assert cut_at_stops("", "say abcd", ["ab", "abc"], final=False).stop_sequence == "ab"
    # A stop string split across deltas: held back as pending text, then named when it completes.
    first = cut_at_stops("", "one END", ["ENDING", "x"], final=False)
    assert (first.text, first.pending_text, first.stop_sequence) == ("one ", "END", "")
    second = cut_at_stops(first.pending_text, "ING two", ["ENDING", "x"], final=False)
    assert (second.text, second.pending_text, second.stop_sequence) == ("", "", "ENDING")
    assert cut_at_stops("", "text", ["", "zz"], final=False).text == "text"
    assert held_length("abcab", ["abcabd"]) == 5
    assert held_length("aab", ["ab"]) == 0
    assert held_length("xa", ["ab", "abc"]) == 1


@pytest.mark.real_model
def test_real_tokenizer_any_split_concatenates_to_the_full_decode(smol: ModelTokenizer) -> None:
    check_concatenation_property(smol, seed=2, trials=150)


@pytest.mark.real_model
def test_real_tokenizer_stop_strings(smol: ModelTokenizer) -> None:
    ids = encode(smol, "The capital of France is Paris. 你好，世界 🙂")
    for cut in range(1, len(ids)):
        texts, stopped, _ = stream(smol, [ids[:cut], ids[cut:]], stop=["Paris", "世界"])
        assert stopped
        assert "".join(texts) == "The capital of France is "
