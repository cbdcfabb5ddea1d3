"""The prefix-cache benchmarks' prompts, as token ids of the model's own chat format.

A system prompt of exactly N tokens (an English text repeated and cut), short distinct user
questions, and multi-turn conversations whose every turn resends the whole history (system,
earlier questions and the model's own answers) followed by the new question, as a chat client does.
Pieces are tokenized apart and joined as ids (ChatML: `<|im_start|>role\\n...<|im_end|>\\n`), so a
turn's prompt starts with exactly the previous turn's prompt and answer. This module only builds
ids: it must not load a model nor time anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

_TEXT = (
    "You are the support assistant of a public library. The library opens at nine and closes at "
    "six on weekdays, and at four on Saturdays; it is closed on Sundays and public holidays. Members "
    "may borrow twelve items at once for three weeks, renew them twice online, and reserve items held "
    "at any branch. Late returns cost ten cents a day per item, capped at five dollars. The reading "
    "rooms on the second floor are quiet zones; group study rooms can be booked for two hours. "
)
_SUBJECTS = (
    "opening hours",
    "late fees",
    "renewals",
    "study rooms",
    "reservations",
    "membership cards",
    "printing",
    "lost books",
    "children's events",
    "parking",
    "e-books",
    "accessibility",
    "donations",
    "wifi",
    "quiet zones",
    "holiday closures",
)


class ChatTokens:
    """Token ids of chat messages for one tokenizer, piece by piece."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def system(self, total_tokens: int) -> list[int]:
        """A system message of exactly `total_tokens` ids, its ChatML markers included."""
        head, tail = self.encode("<|im_start|>system\n"), self.encode("<|im_end|>\n")
        body_len = total_tokens - len(head) - len(tail)
        if body_len < 1:
            raise ValueError(f"a system prompt of {total_tokens} tokens cannot hold its ChatML markers")
        body = self.encode(_TEXT)
        while len(body) < body_len:
            body += body
        return head + body[:body_len] + tail

    def user_turn(self, question: str) -> list[int]:
        """A user message and the assistant header the model answers after."""
        return self.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")

    def end_of_answer(self) -> list[int]:
        """What closes the assistant's answer in the history the next turn resends."""
        return self.encode("<|im_end|>\n")


def questions(count: int, offset: int = 0) -> list[str]:
    """`count` short distinct questions (a subject and a number make each one unique)."""
    return [
        f"Question {offset + i}: what should I know about {_SUBJECTS[(offset + i) % len(_SUBJECTS)]}?"
        for i in range(count)
    ]
