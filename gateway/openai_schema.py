"""The OpenAI-compatible HTTP API's request bodies, as pydantic models that parse and check them.

`ChatCompletionRequest` (POST /v1/chat/completions) and `CompletionRequest` (POST /v1/completions) take
the OpenAI field names (with `presence_penalty`, `frequency_penalty`, `logit_bias`, `logprobs` and
`top_logprobs`), Strata's and vLLM's own options as extra body fields (`top_k`, `min_p`, `min_tokens`,
`stop_token_ids`, `prompt_logprobs`, `priority`, ...), and the fields clients send by habit
(`service_tier`, ...) at their default values. The sampling scalars named as the proto names them are
made from the table (strata/sampling.py), so a new one needs no line here. `n` asks for several
samples. A chat request's `logprobs` is a boolean with `top_logprobs` alternatives; a completion's
`logprobs` is the number of alternatives (OpenAI's legacy shape). `response_format` (json_object,
json_schema, and Strata's regex and grammar) and `tools` with `tool_choice` are parsed here and mapped
by openai_mapping.py. A habitual field whose value asks for a feature the gateway lacks is refused
naming the field (`best_of: 3 ...`), and so is a field this API does not know: nothing is ignored in
silence. Parsing is strict about types (a string is not a number), so a wrong type is a field-level
error, never a crash. This module must not know the gRPC request (openai_mapping.py builds it) nor send
anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from strata.sampling import TABLE, SamplingOptions, option_type


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


TABLE_FIELDS = tuple(
    param.name
    for param in TABLE
    if param.http == (param.name,) and param.name in SamplingOptions.__annotations__
)
"""The sampling scalars the body carries under the proto's names: made from the table (typed as the
Python client takes them, None when not sent, checked by the gateway's validation against the table's
range) and copied into the request by name."""

if TYPE_CHECKING:
    # The type checker cannot see fields made at run time; no typed code reads them by name (the
    # mapping copies TABLE_FIELDS by name), and the ones other front doors set are declared in _Common.
    _TableFields = _Body
else:
    _TableFields = create_model(
        "_TableFields",
        __base__=_Body,
        **{
            param.name: (option_type(param.name) | None, Field(default=None, description=param.meaning))
            for param in TABLE
            if param.name in TABLE_FIELDS
        },
    )


class TextPart(_Body):
    """One part of a message's content; only text parts exist here."""

    type: Literal["text"]
    text: str


class CalledFunction(_Body):
    name: str
    arguments: str


class AssistantToolCall(_Body):
    """A call an earlier assistant turn made, as the client sends the conversation back."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    """None only on an assistant turn that made tool calls."""
    name: str | None = None
    """Accepted for the clients that send it; the chat template has no place for it."""
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    """On a "tool" turn: the call it answers."""

    def text(self) -> str:
        """The content as one string: text parts are joined by newlines (as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """response_format.json_schema: OpenAI's named schema."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    """None takes any JSON object."""
    strict: bool | None = None
    """Accepted; the output always follows the schema."""


class ResponseFormat(_Body):
    """text, json_object, json_schema (OpenAI's), or Strata's regex and grammar (a Lark grammar)."""

    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ResponseFormat:
        given = {k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None}
        wanted = {self.type} & {"json_schema", "regex", "grammar"}
        if given != wanted:
            need = f"response_format.{self.type} must be set" if wanted else "no other field is allowed"
            raise ValueError(f"response_format: type {self.type!r} takes exactly its own field ({need})")
        return self


class FunctionDefinition(_Body):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    """The arguments' JSON Schema; None takes any object."""
    strict: bool | None = None
    """Accepted; the arguments always follow the schema."""


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


def _unsupported(field: str, value: object, why: str) -> ValueError:
    return ValueError(f"{field}: {value!r} is not supported ({why}); omit it or send its default")


class _Common(_TableFields):
    """What both endpoints share: sampling, streaming, Strata's options, the habitual fields.

    The sampling scalars come from the table (_TableFields); those declared again here are the ones
    the Anthropic and Responses bodies set by name, typed for the checker, with the HTTP API's own
    defaults (temperature 1, as OpenAI's)."""

    model: str = ""
    """Empty (or absent) takes the gateway's default model."""
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """An end user's id: accepted, and not used."""
    # Strata's own options (extra body fields, as vLLM takes its own).
    stop_token_ids: list[int] | None = None
    speculate: bool = True
    """False keeps the request out of the worker's speculative decoding (same tokens, one a step)."""
    priority: Literal["interactive", "batch"] | None = None
    allow_fallback: bool = False
    no_fallback: bool = False
    truncation: Literal["refuse", "left"] | None = None
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1)
    """Samples of the prompt, in [1, 16] (the pipeline refuses more, naming `n`)."""
    # Fields clients send by habit: their default value only.
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias with its keys (token ids sent as strings, as JSON objects need) read as ints."""
        return {int(key): value for key, value in (self.logit_bias or {}).items()}

    @model_validator(mode="after")
    def _defaults_only(self) -> _Common:
        for key in self.logit_bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias: key {key!r} is not a token id (a decimal integer string)")
        if any(token < 0 for token in self.stop_token_ids or []):
            raise ValueError(f"stop_token_ids: {self.stop_token_ids} must hold token ids >= 0")
        if self.service_tier not in (None, "auto", "default"):
            raise _unsupported("service_tier", self.service_tier, "one tier; use priority instead")
        if self.store:
            raise _unsupported("store", self.store, "completions are not stored")
        return self


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    """False: at most one call in the answer (ToolChoice.single_call)."""
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text"]] | None = None

    def top_alternatives(self) -> int | None:
        """How many alternatives per token to return; None returns no log probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> tuple[str, int | None]:
        """The field that sets the most tokens to generate, and its value (None: neither is set)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @model_validator(mode="after")
    def _one_token_limit(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs: {self.top_logprobs} needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens not in (None, self.max_tokens):
            raise ValueError(
                f"max_completion_tokens: {self.max_completion_tokens} differs from max_tokens: "
                f"{self.max_tokens}; send one of them"
            )
        if self.functions:
            raise _unsupported("functions", "[...]", "send tools instead")
        if self.function_call not in (None, "none", "auto"):
            raise _unsupported("function_call", self.function_call, "send tool_choice instead")
        return self


class CompletionRequest(_Common):
    """POST /v1/completions: one prompt string (or a list holding exactly one)."""

    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0)
    """The legacy shape: how many alternatives per token (0 returns the chosen tokens' only)."""
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def token_limit(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    def top_alternatives(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise _unsupported("prompt", f"a list of {len(self.prompt)}", "one prompt per request")
        if self.echo:
            raise _unsupported("echo", self.echo, "the prompt is not echoed")
        if self.best_of not in (None, 1):
            raise _unsupported("best_of", self.best_of, "best_of is not supported; n returns every sample")
        if self.suffix:
            raise _unsupported("suffix", self.suffix, "no insertion")
        return self
