"""Each token's exact bytes alone, as log probabilities report them (OpenAI's `bytes` and `token`).

Decoding one id alone loses the bytes of a token that holds part of a UTF-8 character (it decodes to
U+FFFD), so the table is read from the vocabulary itself: byte-level BPE (GPT-2, SmolLM2, Llama 3,
Qwen2) maps each byte to one printable character, inverted here; SentencePiece-style vocabularies
(Llama 2, TinyLlama) spell a space as U+2581 and a raw byte as <0xNN>. Special tokens are their text.
The table is built once per tokenizer on first use. This module must not know about gRPC nor about
requests.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_METASPACE = "\u2581"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    spec = json.loads(tokenizer.to_str())
    return "ByteLevel" in json.dumps([spec.get("decoder"), spec.get("pre_tokenizer")])


def token_bytes_table(tokenizer: Tokenizer) -> list[bytes]:
    """The bytes of every id below the tokenizer's vocabulary size (b"" for an id with no token)."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    alphabet = _byte_level_alphabet() if _is_byte_level(tokenizer) else None
    table: list[bytes] = []
    for token_id in range(size):
        piece = tokenizer.id_to_token(token_id)
        if piece is None:
            table.append(b"")
        elif piece in special:
            table.append(piece.encode())
        elif alphabet is not None:
            table.append(
                bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else piece.encode()
            )
        elif match := _BYTE_TOKEN.match(piece):
            table.append(bytes([int(match.group(1), 16)]))
        else:
            table.append(piece.replace(_METASPACE, " ").encode())
    return table
