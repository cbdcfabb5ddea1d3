"""The server-level peer's plan: workload shapes, levels, the alternated schedule and the request bodies.

A shape is prompt tokens x new tokens (`64x64`); a level is a shape at one concurrency, with
`max(concurrency, min_requests)` requests sent through that many closed-loop streams. Every round
runs every level on both contestants back to back; the contestants' order flips every round
(Strata, llama.cpp, Strata, ... then llama.cpp, Strata, ...), so drift and a noisy neighbour hit both
alike. Each (round, level) has its own prompts, the same for both contestants, so neither reuses a
cached prompt of an earlier round. Both get the same /v1/completions body (text prompt, greedy, EOS
ignored, usage in the stream); llama-server also gets `n_predict`, its own name for `max_tokens`.
This module plans; it must not send requests, start servers nor reduce results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.http_driver import body

if TYPE_CHECKING:
    from bench.stack_prompts import Prompt

STRATA = "strata"
LLAMA = "llama.cpp"
CONTESTANTS = (STRATA, LLAMA)


@dataclass(frozen=True, slots=True)
class Shape:
    """Prompt tokens and new tokens of every request of a workload."""

    prompt_tokens: int
    new_tokens: int

    @property
    def name(self) -> str:
        return f"{self.prompt_tokens}x{self.new_tokens}"

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.new_tokens

    @classmethod
    def parse(cls, text: str) -> Shape:
        """`64x64` (prompt tokens x new tokens)."""
        prompt, _, new = text.partition("x")
        if not (prompt.isdigit() and new.isdigit() and int(prompt) > 0 and int(new) > 0):
            raise ValueError(f"shape {text!r} must be PROMPTxNEW with positive token counts, e.g. 64x64")
        return cls(int(prompt), int(new))


@dataclass(frozen=True, slots=True)
class Level:
    """One shape at one concurrency, and how many requests it sends."""

    shape: Shape
    concurrency: int
    requests: int

    @property
    def key(self) -> str:
        return f"{self.shape.name}@{self.concurrency}"


def plan_levels(shapes: list[Shape], concurrencies: list[int], min_requests: int) -> list[Level]:
    """Every shape at every concurrency, in the order given; at least `min_requests` requests each."""
    if not shapes or not concurrencies:
        raise ValueError("the plan needs at least one shape and one concurrency")
    if min(concurrencies) < 1:
        raise ValueError(f"concurrencies {concurrencies} must all be >= 1")
    return [Level(s, c, max(c, min_requests)) for s in shapes for c in concurrencies]


def round_order(round_index: int) -> tuple[str, str]:
    """Strata first in even rounds, llama.cpp first in odd ones."""
    return CONTESTANTS if round_index % 2 == 0 else (LLAMA, STRATA)


def schedule(rounds: int, levels: list[Level]) -> list[list[tuple[Level, str]]]:
    """Per round, every level on both contestants back to back, in the round's order."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    return [
        [(level, contestant) for level in levels for contestant in round_order(index)]
        for index in range(rounds)
    ]


def prompt_seed(tag: str, level: Level) -> str:
    """The seed of one level's prompts under `tag` (`r0`, `r1`, ... per round; `warm`, `check`)."""
    return f"serve-peer/{tag}/{level.key}"


def request_body(contestant: str, prompt: Prompt, new_tokens: int, model: str) -> dict[str, object]:
    """The /v1/completions body for `contestant`: bench/http_driver.py's, plus llama.cpp's n_predict."""
    payload = body(prompt, new_tokens, model)
    if contestant == LLAMA:
        payload["n_predict"] = new_tokens
    elif contestant != STRATA:
        raise ValueError(f"unknown contestant {contestant!r}; choose from {', '.join(CONTESTANTS)}")
    return payload


def slot_tokens(shapes: list[Shape]) -> int:
    """The context one llama-server slot needs: the largest shape's prompt plus new tokens."""
    return max(shape.tokens for shape in shapes)
