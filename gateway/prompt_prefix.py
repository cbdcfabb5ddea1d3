"""What of a prompt a worker likely holds in its prefix cache, known before the prompt is tokenized.

Admission decides at arrival, before tokenizing (admission.py), so the forecast cannot look up token
blocks. It looks up text instead: a request's PromptPrefix is a chain of hashes over its prompt as
bytes (the raw prompt, or each chat message's role and content in order), one at the end of every
PIECE_BYTES, seeded with what else shapes the rendered prompt's start (the tenant, which salts the
worker's cache; the tools and tool choice, which templates render first; the truncation side). Two
requests whose first k pieces hash alike share at least k x PIECE_BYTES bytes of prompt, so the
same rendered tokens up to there.

Each worker stream keeps a CachedPrefixes: the pieces of the prompts its worker prefilled lately,
each with the tokens the prompt held up to that piece, most recently used last, as many as the
worker's KV cache holds tokens (its prefix cache evicts least recently used blocks first, as this
does). `cached_tokens` is what a new prompt would likely find there: the tokens up to its longest
known piece, in whole KV blocks, times how much of such guesses the worker confirmed lately (each
request's first update reports the tokens its cache served). This module does no I/O and must not
forecast (forecast.py prices the uncached rest) nor decide admission.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata.v1 import common_pb2, gateway_pb2

PIECE_BYTES = 256
"""Prompt bytes per hash: finer finds more of a shared prefix, coarser costs fewer hashes."""
MAX_PIECES = 1024
"""Pieces hashed at most (256 KiB of prompt): what lies past them is priced as uncached."""
TRUST_WEIGHT = 0.2
"""Weight of each confirmed guess in the moving share of guessed tokens the worker really served."""


@dataclass(frozen=True, slots=True)
class PromptPrefix:
    """A prompt's chain of piece hashes and its size in bytes."""

    pieces: tuple[int, ...] = ()
    size: int = 0
    """The prompt's bytes as hashed (every piece, and the tail shorter than one)."""


NO_PREFIX = PromptPrefix()


def _seed(request: gateway_pb2.GenerateRequest, tenant: str) -> bytes:
    tools = b"".join(
        f"{tool.name}\0{tool.description}\0{tool.parameters_json}\x1e".encode() for tool in request.tools
    )
    how = request.tool_choice
    choice = f"{how.mode}\0{how.name}\0{how.single_call}\0{request.truncation}".encode()
    return b"\x1f".join((tenant.encode(), tools, choice))


def _turn(message: common_pb2.ChatMessage) -> bytes:
    calls = "".join(f"{call.id}\0{call.name}\0{call.arguments_json}\x1d" for call in message.tool_calls)
    return f"{message.role}\0{message.content}\0{message.tool_call_id}\0{calls}\x1e".encode()


def prompt_prefix(request: gateway_pb2.GenerateRequest, tenant: str) -> PromptPrefix:
    """The request's PromptPrefix: its raw prompt, else its messages, in pieces of PIECE_BYTES."""
    if request.messages:
        text = b"".join(_turn(message) for message in request.messages)
    else:
        text = request.prompt.encode()
    digest = hashlib.blake2b(_seed(request, tenant), digest_size=8)
    pieces = []
    for start in range(0, min(len(text), MAX_PIECES * PIECE_BYTES) - PIECE_BYTES + 1, PIECE_BYTES):
        digest.update(text[start : start + PIECE_BYTES])
        pieces.append(int.from_bytes(digest.copy().digest(), "little"))
    return PromptPrefix(tuple(pieces), len(text))


class CachedPrefixes:
    """One worker stream's recently prefilled prompt pieces. Used from the event loop only."""

    def __init__(self) -> None:
        self._pieces: OrderedDict[int, tuple[int, int]] = OrderedDict()
        """Piece hash -> (the prompt's tokens up to the piece's end, the piece's own share of them);
        least recently used first."""
        self._held = 0
        """Tokens the kept pieces stand for."""
        self.capacity_tokens = 0
        """Tokens the worker's KV cache holds (its hello's memory budget); 0: unknown, keep nothing."""
        self.block_tokens = 1
        """Tokens per KV block: the worker's prefix cache serves whole blocks only."""
        self.trust = 1.0
        """Moving share of guessed cached tokens the worker confirmed (1 before any guess)."""

    def clear(self) -> None:
        """A new stream: the worker may have restarted with an empty cache."""
        self._pieces.clear()
        self._held = 0

    def size(self, kv_tokens: int, kv_blocks: int) -> None:
        """The worker's KV cache: how many tokens it holds, in how many blocks."""
        self.capacity_tokens = kv_tokens
        self.block_tokens = max(1, kv_tokens // kv_blocks) if kv_blocks else 1
        self._evict()

    def cached_tokens(self, prefix: PromptPrefix) -> int:
        """Prompt tokens of `prefix` the worker likely serves from its cache: whole blocks up to the
        longest piece it prefilled lately, scaled by `trust`; 0 when none is known.

        A prompt's earlier pieces are kept at least as long as its later ones (`prefilled`), so the
        kept ones of a chain are a prefix of it: a binary search finds the longest."""
        low, high = 0, len(prefix.pieces)
        while low < high:
            middle = (low + high + 1) // 2
            if prefix.pieces[middle - 1] in self._pieces:
                low = middle
            else:
                high = middle - 1
        if low == 0:
            return 0
        tokens = self._pieces[prefix.pieces[low - 1]][0]
        return int(tokens * self.trust) // self.block_tokens * self.block_tokens

    def prefilled(self, prefix: PromptPrefix, prompt_tokens: int) -> None:
        """The worker computed (or found cached) this prompt of `prompt_tokens` tokens: its pieces are
        in its cache now, the most recently used, the earliest last (as the worker's cache evicts a
        prompt's tail blocks before its head)."""
        if not prefix.pieces or prefix.size <= 0:
            return
        share = prompt_tokens * PIECE_BYTES / prefix.size
        for index in range(len(prefix.pieces), 0, -1):
            piece = prefix.pieces[index - 1]
            if piece in self._pieces:
                self._pieces.move_to_end(piece)
                continue
            own = max(1, int(share))
            self._pieces[piece] = (int(index * share), own)
            self._held += own
        self._evict()

    def confirmed(self, guessed: int, served: int) -> None:
        """A request sent with `guessed` cached tokens found `served` in the worker's cache."""
        if guessed > 0:
            self.trust += TRUST_WEIGHT * (min(1.0, served / guessed) - self.trust)

    def _evict(self) -> None:
        while self._pieces and self._held > self.capacity_tokens:
            _, (_, own) = self._pieces.popitem(last=False)
            self._held -= own
