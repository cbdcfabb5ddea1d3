"""The one table of sampling parameters: each field of common.proto's SamplingParams, what it means,
its default and range, and its name in every front door (the HTTP API's body, the Python client's
keyword arguments, `strata generate`'s flags).

`SamplingOptions` is the scalars the Python client (strata.client, strata.generate_request) and
`strata generate` take under the proto's names, with their types: they copy and expose each one from
here, and so does the HTTP API's body (gateway/openai_schema.py). `SamplingParams` is the engine's
record of a request's parameters, with its defaults and its own checks (what a gateway cannot know:
the prompt's length against the context); the worker builds it from the proto by name. So a scalar
parameter is added to the proto, this module, its processor and its docs, and to nothing else.

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
from dataclasses import dataclass, field
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
class TableEntry:
    """One field of common.proto's SamplingParams and where each front door exposes it (None: it does not)."""

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


def _entry(
    name: str,
    default: str,
    meaning: str,
    *,
    valid: str | None = None,
    http: Names = OWN,
    client: Names = OWN,
    cli: Names = OWN,
) -> TableEntry:
    """A table entry: its range is BOUNDS' unless `valid` says it; each front door names it as the
    proto does (OWN) unless given its names, or None where the door does not expose it."""

    def names(given: Names) -> tuple[str, ...] | None:
        return (name,) if isinstance(given, str) else given

    if valid is None:
        valid = BOUNDS[name].text if name in BOUNDS else ""
    return TableEntry(name, default, valid, meaning, names(http), names(client), names(cli))


TABLE: tuple[TableEntry, ...] = (
    _entry("max_new_tokens", "the gateway's default_max_new_tokens", "tokens to generate at most",
           valid=">= 1, and room in the context", http=("max_tokens", "max_completion_tokens")),
    _entry("temperature", "0 (gRPC), 1 (HTTP)", "the logits' divisor before sampling"),
    _entry("top_p", "1 (off)", "nucleus sampling: keep the smallest set of tokens with this mass"),
    _entry("top_k", "0 (off)", "keep the k most likely tokens"),
    _entry("repetition_penalty", "1 (off)", "divides the logits of tokens already seen (> 1 discourages)"),
    _entry("no_repeat_ngram_size", "0 (off)", "never repeat an n-gram of this size", cli=None),
    _entry("stop", "none", "strings that end the text (cut before them)",
           valid="at most the gateway's max_stop_strings, each non-empty"),
    _entry("seed", "random", "makes sampling repeatable"),
    _entry("ignore_eos", "false", "go on past EOS", cli=None),
    _entry("presence_penalty", "0 (off)", "subtracted once from the logit of every token generated so far"),
    _entry("frequency_penalty", "0 (off)", "subtracted from a token's logit once per time it was generated"),
    _entry("min_p", "0 (off)", "drop tokens below min_p times the top token's probability"),
    _entry("typical_p", "1 (off)", "locally typical sampling: keep the tokens whose surprisal is nearest "
           "the entropy until they hold this mass"),
    _entry("logit_bias", "none", "added to listed tokens' logits first",
           valid=f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, each in "
           f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", cli=None),
    _entry("stop_token_ids", "none", "token ids that end generation like EOS",
           valid=f"at most {MAX_STOP_TOKEN_IDS} ids", cli=None),
    _entry("min_tokens", "0 (off)", "nothing ends the text before this many tokens",
           valid="[0, max_new_tokens]"),
    _entry("logprobs", "false", "return each generated token's log probability"),
    _entry("top_logprobs", "0", "and this many most likely alternatives at each position",
           valid=f"{BOUNDS['top_logprobs'].text}, with logprobs", client=("logprobs",), cli=("logprobs",)),
    _entry("prompt_logprobs", "unset (off)",
           "return each prompt token's log probability, with this many alternatives", cli=None),
    _entry("no_speculation", "false", "keep this request out of speculative decoding",
           http=("speculate",), client=("speculate",), cli=None),
    _entry("constraint", "unset (free text)", "the language the output must belong to",
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


# The engine's scalar fields checked by the table's rule, and the table's name of each: `logprobs`
# here is the count of alternatives, common.proto's top_logprobs; the others share the table's name.
_BOUNDED = {{"top_logprobs": "logprobs"}.get(name, name): name for name in BOUNDS}


class InvalidRequestError(ValueError):
    """A request parameter is out of range. Names the field, the value and the limit it broke."""

    def __init__(self, field_name: str, value: object, limit: str) -> None:
        self.field = field_name
        self.value = value
        self.limit = limit
        super().__init__(f"{field_name}={value!r} is invalid: {limit}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. Defaults are greedy decoding with no penalties.

    temperature 0 means greedy; top_k 0 and top_p 1.0 mean no filtering; seed None lets the engine
    pick one at admission, so every request draws from the same counter-based noise.

    The OpenAI/vLLM processors (the worker's services/worker/engine/logits_processors.py) are off at their
    defaults: presence and frequency penalties 0, min_p 0, typical_p 1, no logit_bias, min_tokens 0.
    logprobs None returns no log probabilities; N >= 0 returns each sampled token's and its N most likely
    alternatives'. prompt_logprobs likewise for the prompt's tokens. prior_output_tokens counts the
    trailing prompt ids that are a failed worker's output, which the penalties and min_tokens count as
    output. speculate False keeps the request out of speculative decoding where the engine has it on (its
    tokens are the same either way; only its steps' shape changes).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    typical_p: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prior_output_tokens: int = 0
    speculate: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, prompt_len: int, max_model_len: int) -> None:
        """Raise InvalidRequestError for the first parameter out of range."""
        if prompt_len <= 0:
            raise InvalidRequestError("prompt", "<empty>", "the prompt must hold at least one token")
        if prompt_len >= max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{prompt_len} tokens",
                f"must be shorter than the model's context of {max_model_len} tokens",
            )
        room = max_model_len - prompt_len
        if self.max_new_tokens < 1 or self.max_new_tokens > room:
            raise InvalidRequestError(
                "max_new_tokens",
                self.max_new_tokens,
                f"must be in [1, {room}] (context {max_model_len} minus the prompt's {prompt_len} tokens)",
            )
        for name, table_name in _BOUNDED.items():
            value = getattr(self, name)
            problem = None if value is None else out_of_bounds(table_name, value)
            if problem is not None:
                raise InvalidRequestError(name, value, problem)
        for token in self.stop_token_ids:
            if token < 0:
                raise InvalidRequestError("stop_token_ids", token, "token ids must be >= 0")
        self._validate_processors()

    def _validate_processors(self) -> None:
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidRequestError("logit_bias", token, "token ids must be >= 0")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias[{token}]", bias, f"must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequestError(
                "min_tokens", self.min_tokens, f"must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if self.prior_output_tokens < 0:
            raise InvalidRequestError("prior_output_tokens", self.prior_output_tokens, "must be >= 0")
