"""Tokenizing a batch of prompts: chat template or raw text, one batched encode per model, truncation.

A conversation with tools is rendered as tool_prompt.py says: through the template's own tool format
when it has one, in Strata's wording otherwise.

Raw prompts are encoded the way Hugging Face encodes them for that tokenizer (its post-processor adds
any BOS); chat-templated text is encoded without special tokens, since the template already wrote
them. A bad entry fails alone: its outcome is the TokenizerError, the others are encoded. This module
must not know about gRPC status codes (errors.py maps them) nor hold state between calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.tokenizer import tool_prompt
from services.tokenizer.errors import InvalidArgument, NoChatTemplate, TokenizerError
from strata.v1 import gateway_pb2

if TYPE_CHECKING:
    from collections.abc import Sequence

    from services.tokenizer.registry import ModelTokenizer, TokenizerRegistry
    from strata.v1 import tokenizer_pb2

REFUSE = (gateway_pb2.TRUNCATION_UNSPECIFIED, gateway_pb2.TRUNCATION_REFUSE)


@dataclass(frozen=True)
class Tokenized:
    """A prompt's token ids after the chat template and truncation."""

    token_ids: list[int]
    truncated_tokens: int = 0


def tokenize_entries(
    registry: TokenizerRegistry, entries: Sequence[tokenizer_pb2.TokenizeEntry]
) -> list[Tokenized | TokenizerError]:
    """One outcome per entry, in order: its tokens, or why it was refused."""
    outcomes: list[Tokenized | TokenizerError | None] = [None] * len(entries)
    # Entries of one model and one kind of text share one encode_batch call.
    groups: dict[tuple[str, bool], list[tuple[int, str]]] = {}
    for index, entry in enumerate(entries):
        try:
            model = registry.get(entry.model)
            text, templated = prompt_text(model, entry)
        except TokenizerError as error:
            outcomes[index] = error
            continue
        groups.setdefault((model.name, templated), []).append((index, text))
    for (name, templated), items in groups.items():
        model = registry.get(name)
        encoded = model.encode_batch([text for _, text in items], add_special_tokens=not templated)
        for (index, _), ids in zip(items, encoded, strict=True):
            try:
                outcomes[index] = fit(ids, entries[index], name)
            except TokenizerError as error:
                outcomes[index] = error
    return [outcome for outcome in outcomes if outcome is not None]


def prompt_text(model: ModelTokenizer, entry: tokenizer_pb2.TokenizeEntry) -> tuple[str, bool]:
    """The text to encode and whether it came from the chat template; checks what can be checked early."""
    if entry.truncation not in (*REFUSE, gateway_pb2.TRUNCATION_LEFT):
        raise InvalidArgument(
            f"truncation: {entry.truncation} is not a known Truncation value; "
            "use TRUNCATION_REFUSE or TRUNCATION_LEFT"
        )
    if entry.messages:
        if model.chat_template is None:
            raise NoChatTemplate(
                f"messages: model '{model.name}' has no chat template, so it cannot take a conversation; "
                "send a raw prompt instead"
            )
        template = model.chat_template
        turns, tools = tool_prompt.conversation(
            list(entry.messages), list(entry.tools), entry.tool_choice, template.renders_tools
        )
        return template.render(turns, tools), True
    if not entry.prompt:
        raise InvalidArgument("prompt: empty, and messages is empty too; set one of them")
    return entry.prompt, False


def fit(ids: list[int], entry: tokenizer_pb2.TokenizeEntry, model: str) -> Tokenized:
    """Apply the entry's token limit: refuse, or keep the last max_input_tokens ids."""
    if not ids:
        raise InvalidArgument(
            f"prompt: it encodes to no tokens with model '{model}'s tokenizer; send some text"
        )
    limit = entry.max_input_tokens
    if limit == 0 or len(ids) <= limit:
        return Tokenized(ids)
    if entry.truncation in REFUSE:
        raise InvalidArgument(
            f"prompt is {len(ids)} tokens, but model '{model}' accepts at most {limit} input tokens "
            "(its context minus max_new_tokens); shorten it or set truncation=TRUNCATION_LEFT"
        )
    return Tokenized(ids[len(ids) - limit :], truncated_tokens=len(ids) - limit)
