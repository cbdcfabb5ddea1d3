"""A thinking model's answer split into its reasoning and the answer proper.

A model whose tokenizer has `<think>` and `</think>` as tokens of their own (Qwen3's; the tokenizer
service says so per model, `TokenizerModel.think_tokens`) may open its answer with its reasoning
between them. `ReasoningSplit.take` reads a stream's text as it comes and answers the part that is
reasoning and the part that is answer: text that starts with `<think>` (after whitespace) is
reasoning up to `</think>`, the newlines after which are dropped; anything else is answer from the
first character. A tag split across chunks is held until it is whole. `finish` takes the last chunk
and lets go of what was held (an unclosed reasoning stays reasoning). `split` does the same for a
whole answer. For a model without those tokens the split is off and every character is answer. This
module must not know an API's shapes nor do I/O.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


class ReasoningSplit:
    """One answer's text, read as reasoning, then answer."""

    def __init__(self, enabled: bool) -> None:
        self._state = "start" if enabled else "answer"
        self._held = ""

    def take(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of the text so far that can be told apart now."""
        if self._state == "answer":
            return "", text
        self._held += text
        reasoning, answer = "", ""
        if self._state == "start":
            start = self._held.lstrip()
            if start.startswith(OPEN):
                self._state, self._held = "reasoning", start[len(OPEN) :]
            elif OPEN.startswith(start):
                return "", ""  # whitespace, or the tag's first characters: undecided
            else:
                self._state, answer, self._held = "answer", self._held, ""
                return "", answer
        if self._state == "reasoning":
            end = self._held.find(CLOSE)
            if end >= 0:
                reasoning, rest = self._held[:end], self._held[end + len(CLOSE) :]
                self._state, self._held = "after", rest
            else:
                keep = _partial_suffix(self._held, CLOSE)
                reasoning, self._held = (
                    self._held[: len(self._held) - keep],
                    self._held[len(self._held) - keep :],
                )
                return reasoning, ""
        if self._state == "after":
            rest = self._held.lstrip("\n")
            if rest:
                self._state, self._held, answer = "answer", "", rest
        return reasoning, answer

    def finish(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of the last chunk, with whatever was held."""
        reasoning, answer = self.take(text)
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return reasoning + held, answer
        if self._state == "start":
            return reasoning, answer + held
        return reasoning, answer

    @staticmethod
    def split(text: str, enabled: bool) -> tuple[str, str]:
        """(reasoning, answer) of a whole answer."""
        return ReasoningSplit(enabled).finish(text)


def _partial_suffix(text: str, tag: str) -> int:
    """How many of `text`'s last characters could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
