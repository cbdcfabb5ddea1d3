"""The one table of sampling parameters: each field of common.proto's SamplingParams, what it means,
its default and range, and its name in every front door (the HTTP API's body, the Python client's
keyword arguments, `strata generate`'s flags).

`SamplingOptions` is the scalars the Python client (strata.client, strata.generate_request) and
`strata generate` take under the proto's names, with their types: they copy and expose each one from
here, so a scalar parameter is added to the proto, this table and its processor, not to them.

The limits the gateway and the worker check are defined here and nowhere else, and so is the rule
for each scalar's range (BOUNDS, `out_of_bounds`): the gateway's validation and the engine's apply
the same rule and say it in the same words. The front doors are checked against the table by
tests/unit/test_sampling_table.py, which fails when a field is added to one of them (or to the proto)
and not to the table, or the other way round. This module must not import a service, the gateway or
grpc: every layer reads it.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict

if TYPE_CHECKING:
    from collections.abc import Iterable

    from google.protobuf.message import Message

MAX_PENALTY = 2.0
"""OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]."""
MAX_LOGIT_BIAS = 100.0
"""OpenAI's range for one logit bias: [-100, 100]."""
MAX_LOGIT_BIAS_ENTRIES = 300
"""OpenAI's most logit_bias entries."""
MAX_TOP_LOGPROBS = 20
"""OpenAI's most top alternatives per position (top_logprobs, prompt_logprobs)."""
MAX_STOP_TOKEN_IDS = 32
"""vLLM's most stop_token_ids."""
SEED_LIMIT = 2**63
"""Seeds are below this (a signed 64-bit generator state)."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """The range a scalar sampling parameter must be in: a finite number between its ends."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    high_text: str = ""
    """How the high end is written when its digits would say less (2**63)."""
    off: str = ""
    """What the value that turns it off is, as the message adds it ("0 turns it off")."""

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    @property
    def text(self) -> str:
        """The range as a message says it: ">= 0", "> 0", "in (0, 1]", "in [0, 2**63)"."""
        assert self.low is not None, "every range here has a low end"
        if self.high is None:
            rule = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            high = self.high_text or f"{self.high:g}"
            rule = f"in {'(' if self.low_open else '['}{self.low:g}, {high}{')' if self.high_open else ']'}"
        return f"{rule} ({self.off})" if self.off else rule


_PENALTY = Bounds(-MAX_PENALTY, MAX_PENALTY, off="0 turns it off")
_ALTERNATIVES = Bounds(0, MAX_TOP_LOGPROBS)
BOUNDS: dict[str, Bounds] = {
    "temperature": Bounds(0, off="0 is greedy"),
    "top_p": Bounds(0, 1, low_open=True),
    "top_k": Bounds(0, off="0 turns it off"),
    "repetition_penalty": Bounds(0, low_open=True),
    "no_repeat_ngram_size": Bounds(0, off="0 turns it off"),
    "seed": Bounds(0, SEED_LIMIT, high_open=True, high_text=f"2**{SEED_LIMIT.bit_length() - 1}"),
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "min_p": Bounds(0, 1, off="0 turns it off"),
    "typical_p": Bounds(0, 1, low_open=True),
    "top_logprobs": _ALTERNATIVES,
    "prompt_logprobs": _ALTERNATIVES,
}
"""Each scalar parameter's range; the gateway and the engine check a value they were given against it."""


def out_of_bounds(name: str, value: float) -> str | None:
    """Why `value` is not a valid `name` ("must be in (0, 1]"), or None when it is."""
    bounds = BOUNDS[name]
    return None if bounds.holds(value) else f"must be {bounds.text}"


def as_sent(message: Message, names: Iterable[str]) -> dict[str, Any]:
    """The named fields of a SamplingParams message as its sender set them: a field with presence
    (proto3 `optional`: unset means "the default") only when it was set, any other always, its zero
    being its value. The gateway checks these, the worker copies them."""
    present = {field.name for field, _ in message.ListFields()}
    fields = message.DESCRIPTOR.fields_by_name
    sent = (name for name in names if not fields[name].has_presence or name in present)
    return {name: getattr(message, name) for name in sent}


@dataclass(frozen=True, slots=True)
class SamplingParam:
    """One field of SamplingParams and where each front door exposes it (None: it does not)."""

    name: str
    """Its name in common.proto's SamplingParams."""
    default: str
    valid: str
    """The range a value must be in, as the errors and the docs say it."""
    meaning: str
    http: tuple[str, ...] | None
    """The HTTP API's body fields (either endpoint's) that set it."""
    client: tuple[str, ...] | None
    """strata.client's keyword arguments that set it."""
    cli: tuple[str, ...] | None
    """`strata generate`'s options (argparse destinations) that set it."""


_CONSTRAINT_OPTIONS = ("json_schema", "json_object", "regex", "grammar")
"""The client's keyword arguments and the CLI's options for the constraint's four kinds."""


OWN: Literal["own"] = "own"
"""A front door names the parameter as the proto does."""
Names = tuple[str, ...] | Literal["own"] | None


def _param(
    name: str,
    default: str,
    meaning: str,
    *,
    valid: str | None = None,
    http: Names = OWN,
    client: Names = OWN,
    cli: Names = OWN,
) -> SamplingParam:
    """A table entry: its range is BOUNDS' unless `valid` says it; each front door names it as the
    proto does (OWN) unless given its names, or None where the door does not expose it."""

    def names(given: Names) -> tuple[str, ...] | None:
        return (name,) if isinstance(given, str) else given

    if valid is None:
        valid = BOUNDS[name].text if name in BOUNDS else ""
    return SamplingParam(name, default, valid, meaning, names(http), names(client), names(cli))


SAMPLING_PARAMS: tuple[SamplingParam, ...] = (
    _param("max_new_tokens", "the gateway's default_max_new_tokens", "tokens to generate at most",
           valid=">= 1, and room in the context", http=("max_tokens", "max_completion_tokens")),
    _param("temperature", "0 (gRPC), 1 (HTTP)", "the logits' divisor before sampling"),
    _param("top_p", "1 (off)", "nucleus sampling: keep the smallest set of tokens with this mass"),
    _param("top_k", "0 (off)", "keep the k most likely tokens"),
    _param("repetition_penalty", "1 (off)", "divides the logits of tokens already seen (> 1 discourages)"),
    _param("no_repeat_ngram_size", "0 (off)", "never repeat an n-gram of this size", cli=None),
    _param("stop", "none", "strings that end the text (cut before them)",
           valid="at most the gateway's max_stop_strings, each non-empty"),
    _param("seed", "random", "makes sampling repeatable"),
    _param("ignore_eos", "false", "go on past EOS", cli=None),
    _param("presence_penalty", "0 (off)", "subtracted once from the logit of every token generated so far"),
    _param("frequency_penalty", "0 (off)", "subtracted from a token's logit once per time it was generated"),
    _param("min_p", "0 (off)", "drop tokens below min_p times the top token's probability"),
    _param("typical_p", "1 (off)", "locally typical sampling: keep the tokens whose surprisal is nearest "
           "the entropy until they hold this mass"),
    _param("logit_bias", "none", "added to listed tokens' logits first",
           valid=f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, each in "
           f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", cli=None),
    _param("stop_token_ids", "none", "token ids that end generation like EOS",
           valid=f"at most {MAX_STOP_TOKEN_IDS} ids", cli=None),
    _param("min_tokens", "0 (off)", "nothing ends the text before this many tokens",
           valid="[0, max_new_tokens]"),
    _param("logprobs", "false", "return each generated token's log probability"),
    _param("top_logprobs", "0", "and this many most likely alternatives at each position",
           valid=f"{BOUNDS['top_logprobs'].text}, with logprobs", client=("logprobs",), cli=("logprobs",)),
    _param("prompt_logprobs", "unset (off)",
           "return each prompt token's log probability, with this many alternatives", cli=None),
    _param("no_speculation", "false", "keep this request out of speculative decoding",
           http=("speculate",), client=("speculate",), cli=None),
    _param("constraint", "unset (free text)", "the language the output must belong to",
           valid="one of a JSON schema, any JSON object, a regex, a Lark grammar",
           http=("response_format",), client=_CONSTRAINT_OPTIONS, cli=_CONSTRAINT_OPTIONS),
)  # fmt: skip


class SamplingOptions(TypedDict, total=False):
    """The scalar sampling parameters the Python client and `strata generate` take under their proto
    names, each copied into SamplingParams as given; None (or absent) leaves it unset, so the gateway
    applies its default."""

    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    repetition_penalty: float | None
    no_repeat_ngram_size: int | None
    seed: int | None
    ignore_eos: bool | None
    presence_penalty: float | None
    frequency_penalty: float | None
    min_p: float | None
    typical_p: float | None
    min_tokens: int | None
    prompt_logprobs: int | None


def option_type(name: str) -> type:
    """The Python type of the scalar option `name` (int, float or bool)."""
    hint = typing.get_type_hints(SamplingOptions)[name]
    found: type = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return found
