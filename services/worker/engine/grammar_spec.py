"""What a request's output constraint says, as the engine reads it: a kind, its source text, its key.

A GrammarSpec is plain data: the wire's OutputConstraint after the first checks (exactly one kind,
a size bound, a JSON schema that parses as a JSON object). Its key is the sha256 of kind and source,
under which the compiler caches what it built. Errors name the wire field
(`sampling.constraint.json_schema`). This module must not import the grammar library nor torch: the
scheduler and the converters read it.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass

from strata.sampling import InvalidRequestError

# The largest constraint source accepted, in bytes: a generous schema is a few KiB.
MAX_CONSTRAINT_BYTES = 64 * 1024
FIELD_PREFIX = "sampling.constraint."
# The worker's settings default to these (services/worker/settings.py), the compiler too.
DEFAULT_COMPILE_TIMEOUT_S = 2.0
DEFAULT_GRAMMAR_CACHE_SIZE = 256


class GrammarKind(enum.StrEnum):
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    LARK = "lark_grammar"


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One constraint: its kind and source (for JSON_OBJECT the source is empty)."""

    kind: GrammarKind
    source: str = ""

    @property
    def field(self) -> str:
        """The wire field that carried it, for error messages."""
        return FIELD_PREFIX + self.kind.value

    @property
    def key(self) -> str:
        """sha256 hex of kind and source: equal specs compile once."""
        return hashlib.sha256(f"{self.kind.value}\0{self.source}".encode()).hexdigest()

    @classmethod
    def of(cls, kind: str, source: str | bool) -> GrammarSpec:
        """Check a constraint's kind and source; raise InvalidRequestError naming the field."""
        try:
            grammar_kind = GrammarKind(kind)
        except ValueError:
            raise InvalidRequestError(
                "sampling.constraint", kind, f"must set one of {', '.join(k.value for k in GrammarKind)}"
            ) from None
        field = FIELD_PREFIX + grammar_kind.value
        if grammar_kind is GrammarKind.JSON_OBJECT:
            if source is not True:
                raise InvalidRequestError(field, source, "must be true when set")
            return cls(grammar_kind)
        if not isinstance(source, str) or not source.strip():
            raise InvalidRequestError(field, source, "must not be empty")
        size = len(source.encode())
        if size > MAX_CONSTRAINT_BYTES:
            raise InvalidRequestError(field, f"{size} bytes", f"must be at most {MAX_CONSTRAINT_BYTES} bytes")
        if grammar_kind is GrammarKind.JSON_SCHEMA:
            try:
                schema = json.loads(source)
            except ValueError as exc:
                raise InvalidRequestError(field, source[:80], f"must be JSON text: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError(field, source[:80], "must be a JSON object (or true/false)")
        return cls(grammar_kind, source)
