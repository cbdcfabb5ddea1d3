"""Prompt texts that tokenize to an exact number of tokens with the model's own tokenizer.

`strata bench` sends text (the gateway tokenizes it), yet its workload is specified in tokens and the
engine baseline needs the very same token ids. So each prompt is built word by word and measured with
the model's tokenizer until it holds exactly the wanted count; the ids are kept for the engine. Words
are shuffled per request, so no two prompts share a prefix worth caching. This module must not talk
to the stack nor load a model: it only needs tokenizer.json.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from tokenizers import Tokenizer

# Common English words: one token each (after a space) with most real tokenizers, so a prompt of N
# tokens is about N words, and shuffling them makes distinct prompts.
_WORDS_TEXT = (
    "the of and to in is was for on that with as by at from his her they this have are not but had "
    "which one were all their there been has more when will would who what about some them into time "
    "only could new these two may first then any like other how over such our man well also back after "
    "use year most work way even day many old see long great make where much here world last life down "
    "land water house light river city story music paper table garden window market winter summer "
    "morning evening mountain forest ocean bridge school letter friend doctor teacher kitchen animal "
    "number colour simple quiet bright early small large green blue yellow orange silver golden wooden"
)
WORDS = tuple(_WORDS_TEXT.split())
# Single characters that each start a new pre-token, to fill the last few tokens exactly when every
# word would overshoot (byte-level vocabularies hold every byte, so one of them always fits).
FILLERS = (".", ",", ";", ":", "!", "?", "a", "e", "o", "s", "1", "-")


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's text and the ids the model's tokenizer makes of it."""

    text: str
    token_ids: tuple[int, ...]


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The model folder's tokenizer.json, the file the tokenizer service loads too."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}; pass --model-dir with a model folder")
    return Tokenizer.from_file(str(path))


def build_prompt(tokenizer: Tokenizer, tokens: int, rng: random.Random) -> Prompt:
    """A text of exactly `tokens` tokens: shuffled words while one fits, then filler characters.

    Each step re-encodes the whole text rather than summing per-word counts, since merges may cross
    the seam between pieces; a step is only taken when the count grows and stays within `tokens`.
    """
    if tokens < 1:
        raise ValueError(f"tokens={tokens} must be >= 1")
    words = list(WORDS)
    rng.shuffle(words)
    fillers = rng.sample(FILLERS, len(FILLERS))
    text, count, cursor = "", 0, 0
    while count < tokens:
        step = _next_piece(tokenizer, text, count, tokens, words, fillers, cursor)
        if step is None:
            raise ValueError(f"cannot build a text of exactly {tokens} tokens (stuck at {count}: {text!r})")
        text, count, cursor = step
    ids = tuple(tokenizer.encode(text).ids)
    return Prompt(text, ids)


def _next_piece(
    tokenizer: Tokenizer,
    text: str,
    count: int,
    tokens: int,
    words: list[str],
    fillers: list[str],
    cursor: int,
) -> tuple[str, int, int] | None:
    for offset in range(len(words)):
        word = words[(cursor + offset) % len(words)]
        candidate = f"{text} {word}" if text else word.capitalize()
        grown = len(tokenizer.encode(candidate).ids)
        if count < grown <= tokens:
            return candidate, grown, cursor + offset + 1
    for filler in fillers:
        candidate = text + filler
        grown = len(tokenizer.encode(candidate).ids)
        if count < grown <= tokens:
            return candidate, grown, cursor
    return None


def build_prompts(tokenizer: Tokenizer, count: int, tokens: int, seed: str) -> list[Prompt]:
    """`count` distinct prompts of exactly `tokens` tokens, the same for the same `seed`."""
    prompts: list[Prompt] = []
    seen: set[str] = set()
    attempt = 0
    while len(prompts) < count:
        prompt = build_prompt(tokenizer, tokens, random.Random(f"{seed}/{attempt}"))
        attempt += 1
        if prompt.text not in seen:
            seen.add(prompt.text)
            prompts.append(prompt)
        if attempt > 4 * count + 16:
            raise ValueError(f"only {len(prompts)} distinct prompts of {tokens} tokens after {attempt} tries")
    return prompts
