"""Compiles output constraints into grammar matchers, off the engine thread, cached by hash.

The compiler owns the grammar library's view of the model's tokenizer (built once from the model
folder's tokenizer.json, with the model's EOS ids, and fingerprinted like the tokenizer service's
copy), a small pool of compile threads, and an LRU cache of compiled prototypes keyed by the spec's
sha256: a cached spec costs one deep copy. llguidance releases the GIL while it builds a grammar, so
a compile never stalls an engine step; its own fuel limits bound the work of a pathological one, and
callers bound their wait (timeout_s) and refuse the request with INVALID_ARGUMENT past it.
This module must not touch logits (grammar_mask.py does) nor decide when a request runs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import llguidance

from services.worker.engine.grammar_matcher import GrammarMatcher
from services.worker.engine.grammar_spec import (
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_GRAMMAR_CACHE_SIZE,
    GrammarKind,
    GrammarSpec,
)
from strata.fingerprint import tokenizer_fingerprint
from strata.sampling import InvalidRequestError

if TYPE_CHECKING:
    from collections.abc import Iterable
    from pathlib import Path

    from llguidance._lib import JsonCompileOptions

# Compact JSON with one space after ',' and ':' and no other whitespace: what instruct models write
# anyway, and no room for a run of newlines that would spend max_tokens inside a valid document.
JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


def _grammar_text(spec: GrammarSpec) -> str:
    if spec.kind is GrammarKind.JSON_OBJECT:
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS))
    if spec.kind is GrammarKind.JSON_SCHEMA:
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS))
        except ValueError as exc:
            raise InvalidRequestError(spec.field, spec.source[:80], f"is not a JSON schema: {exc}") from None
    if spec.kind is GrammarKind.REGEX:
        return str(llguidance.LLMatcher.grammar_from_regex(spec.source))
    return str(llguidance.LLMatcher.grammar_from_lark(spec.source))


class GrammarCompiler:
    """Builds GrammarMatchers for one model's tokenizer. Thread-safe."""

    def __init__(
        self,
        tokenizer_json: str,
        eos_token_ids: Iterable[int],
        logits_vocab_size: int,
        *,
        fingerprint: str = "",
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE,
        threads: int = 2,
    ) -> None:
        """`logits_vocab_size`: the width of the model's logits, which may exceed the tokenizer's."""
        eos = list(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos or None)
        self.vocab_size = int(self.tokenizer.vocab_size)
        if self.vocab_size > logits_vocab_size:
            raise ValueError(
                f"the tokenizer has {self.vocab_size} ids but the model's logits only {logits_vocab_size}: "
                "serve the tokenizer that came with the model"
            )
        self.logits_vocab_size = logits_vocab_size
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self._cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._pending: dict[str, Future[llguidance.LLMatcher]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="strata-grammar")
        self.compiles = 0
        """Grammars built (cache misses that finished); tests read it."""
        # The first grammar of a tokenizer builds the library's token trie (2.5 s for SmolLM2's 49,152
        # ids on a busy 2-core machine): pay it here, at load, not within a request's time bound.
        self._compile(GrammarSpec(GrammarKind.JSON_OBJECT))

    @classmethod
    def from_model_dir(
        cls, path: Path, eos_token_ids: Iterable[int], logits_vocab_size: int, **options: float | int
    ) -> GrammarCompiler:
        tokenizer = path / "tokenizer.json"
        if not tokenizer.is_file():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json: structured output needs the model's tokenizer"
            )
        return cls(
            tokenizer.read_text(),
            eos_token_ids,
            logits_vocab_size,
            fingerprint=tokenizer_fingerprint(path),
            **options,  # type: ignore[arg-type]
        )

    def lookup(self, spec: GrammarSpec) -> GrammarMatcher | None:
        """A fresh matcher when `spec` is cached, else None (no work is started)."""
        with self._lock:
            prototype = self._cache.get(spec.key)
            if prototype is not None:
                self._cache.move_to_end(spec.key)
        return None if prototype is None else self._wrap(prototype, spec)

    def submit(self, spec: GrammarSpec) -> Future[llguidance.LLMatcher]:
        """Compile `spec` on the pool (or join the compile already running for it)."""
        with self._lock:
            if spec.key in self._cache:
                done: Future[llguidance.LLMatcher] = Future()
                done.set_result(self._cache[spec.key])
                return done
            future = self._pending.get(spec.key)
            if future is None:
                future = self._pool.submit(self._compile, spec)
                self._pending[spec.key] = future
            return future

    def result(self, spec: GrammarSpec, future: Future[llguidance.LLMatcher]) -> GrammarMatcher:
        """The matcher of a finished compile; raises its InvalidRequestError."""
        return self._wrap(future.result(timeout=0), spec)

    def matcher(self, spec: GrammarSpec, timeout_s: float | None = None) -> GrammarMatcher:
        """Blocking: a matcher for `spec`, or InvalidRequestError (bad spec, or no compile in time)."""
        cached = self.lookup(spec)
        if cached is not None:
            return cached
        future = self.submit(spec)
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            future.result(timeout=wait)
        except FutureTimeout:
            raise self.timeout_error(spec, wait) from None
        return self.result(spec, future)

    def timeout_error(self, spec: GrammarSpec, waited_s: float) -> InvalidRequestError:
        return InvalidRequestError(
            spec.field,
            spec.source[:80] or True,
            f"did not compile within {waited_s:g} s (the worker's grammar_compile_timeout_s): simplify it",
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _wrap(self, prototype: llguidance.LLMatcher, spec: GrammarSpec) -> GrammarMatcher:
        return GrammarMatcher(prototype.deep_copy(), spec, self.vocab_size)

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, _grammar_text(spec), log_level=0)
            if matcher.is_error():
                error = _first_lines(matcher.get_error())
                raise InvalidRequestError(spec.field, spec.source[:80] or True, error)
            # The first mask builds the lexer's start state: pay it here, not in an engine step.
            matcher.compute_bitmask()
            with self._lock:
                self._cache[spec.key] = matcher
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                self.compiles += 1
            return matcher
        finally:
            with self._lock:
                self._pending.pop(spec.key, None)


def _first_lines(message: str, limit: int = 400) -> str:
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."
