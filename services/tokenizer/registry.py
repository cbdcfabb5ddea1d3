"""The tokenizers this service holds: one per configured model, loaded once at start from its folder.

A model folder provides tokenizer.json (read with the `tokenizers` library, never transformers, so
torch is never imported), tokenizer_config.json (chat template, special tokens), optionally
chat_template.jinja, special_tokens_map.json and generation_config.json (more end-of-sequence ids).
Each tokenizer is identified by strata.fingerprint.tokenizer_fingerprint, the same hash the workers
compute. A folder that cannot be served is a SettingsError at start. This module must not know about
gRPC nor decide what a request may ask.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from tokenizers import Tokenizer

from services.tokenizer.chat import ChatTemplate
from services.tokenizer.errors import UnknownModel
from services.tokenizer.token_bytes import token_bytes_table
from strata.fingerprint import tokenizer_fingerprint
from strata.settings import SettingsError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# The special-token variables Hugging Face passes to chat templates.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class ModelTokenizer:
    """One model's tokenizer, its identity and its chat template."""

    name: str
    folder: Path
    tokenizer: Tokenizer
    fingerprint: str
    chat_template: ChatTemplate | None
    eos_token_ids: tuple[int, ...]
    skipped_ids: frozenset[int]
    """Special tokens, which decoding leaves out."""
    tool_call_tokens: bool
    """Whether "<tool_call>" and "</tool_call>" are added tokens (Qwen2.5's): grammars name them so."""
    think_tokens: bool
    """Whether "<think>" and "</think>" are added tokens (Qwen3's): an answer may open with reasoning."""
    vocab_size: int

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool) -> list[list[int]]:
        """Token ids of each text; the library encodes the batch in parallel, without the GIL."""
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decodable(self, ids: Sequence[int]) -> list[int]:
        """The ids that decode to text: special ones and ids past the vocabulary decode to nothing."""
        return [i for i in ids if i < self.vocab_size and i not in self.skipped_ids]

    def decode_batch(self, sequences: Sequence[Sequence[int]]) -> list[str]:
        """Text of each id sequence, special tokens left out, incomplete characters as U+FFFD."""
        return self.tokenizer.decode_batch([list(ids) for ids in sequences], skip_special_tokens=True)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """Every token's bytes alone (token_bytes.py), built on the first request for log probabilities."""
        return token_bytes_table(self.tokenizer)

    def pieces(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes of each id alone; b"" for an id past the vocabulary."""
        table = self.token_bytes
        return [table[i] if i < len(table) else b"" for i in ids]


class TokenizerRegistry:
    """The loaded tokenizers by model name."""

    def __init__(self, models: Mapping[str, ModelTokenizer]) -> None:
        self.models = dict(models)

    def get(self, name: str) -> ModelTokenizer:
        """The model's tokenizer; an unknown name is UnknownModel listing the known ones."""
        model = self.models.get(name)
        if model is None:
            known = ", ".join(sorted(self.models))
            raise UnknownModel(
                f"model: {name!r} is not served by this tokenizer service; known models: {known}"
            )
        return model


def load_registry(models: Mapping[str, Path]) -> TokenizerRegistry:
    """Load every configured model's tokenizer; the first unusable folder is a SettingsError."""
    return TokenizerRegistry({name: load_model(name, Path(folder)) for name, folder in models.items()})


def load_model(name: str, folder: Path) -> ModelTokenizer:
    """Load one model's tokenizer, chat template and end-of-sequence ids from its folder."""
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise SettingsError(
            f"tokenizer.models.{name}: {folder} has no tokenizer.json; point it at a Hugging Face model "
            "folder with a fast tokenizer (run `strata fetch-model` for the default one)"
        )
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    # A tokenizer.json may carry truncation or padding from its training; prompts are truncated here,
    # by token count and side, never silently by the file. Set once, before any concurrent use.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    config = _read_json(folder / "tokenizer_config.json", name)
    special = _special_tokens(config, _read_json(folder / "special_tokens_map.json", name))
    template_source = _chat_template_source(folder, config, name)
    template: ChatTemplate | None = None
    if template_source is not None:
        try:
            template = ChatTemplate(template_source, name, special)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise SettingsError(
                f"tokenizer.models.{name}: the chat template in {folder} does not compile ({exc}); "
                "fix or remove it"
            ) from exc
    eos_ids: list[int] = []
    eos_token = special.get("eos_token")
    if eos_token is not None and (eos_id := tokenizer.token_to_id(eos_token)) is not None:
        eos_ids.append(eos_id)
    generation = _read_json(folder / "generation_config.json", name)
    extra = generation.get("eos_token_id")
    for eos_id in extra if isinstance(extra, list) else [extra]:
        if isinstance(eos_id, int) and eos_id not in eos_ids:
            eos_ids.append(eos_id)
    added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    return ModelTokenizer(
        name=name,
        folder=folder,
        tokenizer=tokenizer,
        fingerprint=tokenizer_fingerprint(folder),
        chat_template=template,
        eos_token_ids=tuple(eos_ids),
        skipped_ids=frozenset(
            i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special
        ),
        tool_call_tokens={"<tool_call>", "</tool_call>"} <= added,
        think_tokens={"<think>", "</think>"} <= added,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
    )


def _read_json(path: Path, name: str) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SettingsError(
            f"tokenizer.models.{name}: {path} is not valid JSON ({exc}); fix the file"
        ) from exc
    if not isinstance(data, dict):
        raise SettingsError(f"tokenizer.models.{name}: {path} must hold a JSON object; fix the file")
    return data


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(config: Mapping[str, Any], special_map: Mapping[str, Any]) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for key in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(key))
        if text is None:
            text = _token_text(special_map.get(key))
        if text is not None:
            tokens[key] = text
    return tokens


def _chat_template_source(folder: Path, config: Mapping[str, Any], name: str) -> str | None:
    """chat_template.jinja when present (newer saves), else tokenizer_config.json's chat_template."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template or None
    if isinstance(template, list):
        # The older multi-template form: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                source = entry.get("template")
                return source if isinstance(source, str) else None
        return None
    raise SettingsError(
        f"tokenizer.models.{name}: chat_template in {folder}/tokenizer_config.json must be a string; "
        "fix the file"
    )
