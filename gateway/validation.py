"""Checks a GenerateRequest before any work is done for it, and fills in the gateway's defaults.

Each rule raises InvalidArgument with a message that starts with the offending field's path
(`sampling.top_p: ...`) and says the limit, or NotFound for a model no route serves. Limits that only
the tokenizer or the worker can judge (the prompt's length in tokens) are theirs, and so is whether an
output constraint compiles (the worker's compiler); its shape is checked here. A request with tools
comes out as tool_calls.py prepares it. This module must not do I/O: it is pure and runs on the
request's own task.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway import tool_calls
from gateway.adapter_names import ModelName, resolve
from gateway.errors import InvalidArgument, NotFound
from gateway.request_ids import or_new
from strata.sampling import (
    BOUNDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    as_sent,
    out_of_bounds,
)
from strata.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from gateway.settings import GatewaySettings
    from strata.v1 import tokenizer_pb2

CHAT_ROLES = ("system", "user", "assistant", "tool")
# The worker refuses larger constraints too (services/worker/engine/grammar_spec.py).
MAX_CONSTRAINT_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class ValidRequest:
    """A request that passed validation, with its defaults resolved."""

    request: gateway_pb2.GenerateRequest
    model: str
    """The route's model."""
    request_id: str
    """The caller's id, or a generated uuid4 hex."""
    sampling: common_pb2.SamplingParams
    """The request's sampling with max_new_tokens resolved."""
    adapter: str = ""
    """The LoRA adapter its model names (`<model>:<adapter>` or an alias); "" for the base model."""

    @property
    def stop(self) -> tuple[str, ...]:
        return tuple(self.sampling.stop)


def validate(
    request: gateway_pb2.GenerateRequest,
    settings: GatewaySettings,
    context_limit: Callable[[str], int | None],
    tokenizer_models: Mapping[str, tokenizer_pb2.TokenizerModel],
) -> ValidRequest:
    """Check every field; `context_limit(model)` is the model's context length when a worker reported
    it, `tokenizer_models` what the tokenizer service said of the models' tokenizers (the tool grammar
    names the call and think tags as tokens where they are tokens of their own)."""
    _check_input(request)
    routes = [route.model for route in settings.routes]
    unknown: NotFound | None = None
    try:
        name = resolve(request.model or settings.default_route, routes, settings.adapter_aliases)
    except NotFound as missing:  # reported after the fields' own checks, as before adapters existed
        name, unknown = ModelName(request.model), missing
    model = name.route
    info = tokenizer_models.get(model)
    tags, thinks = (info.tool_call_tokens, info.think_tokens) if info is not None else (False, False)
    request = tool_calls.prepare(request, tags, thinks)
    sampling = _check_sampling(request, settings)
    _check_constraint(sampling)
    request_id = _check_request_id(request.request_id, settings.max_request_id_chars)
    if unknown is not None:
        raise unknown
    if sampling.max_new_tokens == 0:
        sampling.max_new_tokens = settings.default_max_new_tokens
    if sampling.max_new_tokens > settings.max_new_tokens_limit:
        raise InvalidArgument(
            f"sampling.max_new_tokens: {sampling.max_new_tokens} is over this gateway's limit of "
            f"{settings.max_new_tokens_limit} (max_new_tokens_limit); ask for at most that"
        )
    if sampling.min_tokens > sampling.max_new_tokens:
        raise InvalidArgument(
            f"sampling.min_tokens: {sampling.min_tokens} must be at most max_new_tokens "
            f"({sampling.max_new_tokens})"
        )
    limit = context_limit(model)
    if limit is not None and sampling.max_new_tokens >= limit:
        raise InvalidArgument(
            f"sampling.max_new_tokens: {sampling.max_new_tokens} leaves no room for a prompt in "
            f"model {model!r}'s context of {limit} tokens; ask for at most {limit - 1}"
        )
    return ValidRequest(
        request=request,
        model=model,
        request_id=or_new(request_id),
        sampling=sampling,
        adapter=name.adapter,
    )


def _check_input(request: gateway_pb2.GenerateRequest) -> None:
    if bool(request.prompt) == bool(request.messages):
        raise InvalidArgument("prompt: set exactly one of prompt and messages")
    for index, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{index}].role: {message.role!r} is not one of {', '.join(CHAT_ROLES)}"
            )
        if message.tool_calls and message.role != "assistant":
            raise InvalidArgument(f"messages[{index}].tool_calls: only an assistant turn makes calls")
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidArgument(f"messages[{index}].tool_call_id: a tool turn names the call it answers")
        if not message.content and not message.tool_calls:
            raise InvalidArgument(f"messages[{index}].content: must not be empty")
    if request.truncation not in gateway_pb2.Truncation.values():
        raise InvalidArgument(f"truncation: {request.truncation} is not a Truncation value")


def _check_sampling(
    request: gateway_pb2.GenerateRequest, settings: GatewaySettings
) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(request.sampling)
    if sampling.max_new_tokens < 0:
        raise InvalidArgument(
            f"sampling.max_new_tokens: {sampling.max_new_tokens} must be >= 0 (0 takes the default)"
        )
    _check_bounds(sampling)
    if len(sampling.stop) > settings.max_stop_strings:
        raise InvalidArgument(
            f"sampling.stop: {len(sampling.stop)} stop strings, at most {settings.max_stop_strings} allowed"
        )
    _check_processors(sampling)
    _check_logprobs(sampling)
    for index, stop in enumerate(sampling.stop):
        if not stop:
            raise InvalidArgument(f"sampling.stop[{index}]: must not be empty")
        size = len(stop.encode())
        if size > settings.max_stop_string_bytes:
            raise InvalidArgument(
                f"sampling.stop[{index}]: {size} bytes, at most {settings.max_stop_string_bytes} allowed"
            )
    return sampling


def _check_constraint(sampling: common_pb2.SamplingParams) -> None:
    if not sampling.HasField("constraint"):
        return
    kind = sampling.constraint.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(
            "sampling.constraint: set one of json_object, json_schema, regex and lark_grammar (or unset it)"
        )
    if kind == "json_object":
        if not sampling.constraint.json_object:
            raise InvalidArgument("sampling.constraint.json_object: must be true when set")
        return
    source = getattr(sampling.constraint, kind)
    size = len(source.encode())
    if not source.strip():
        raise InvalidArgument(f"sampling.constraint.{kind}: must not be empty")
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidArgument(
            f"sampling.constraint.{kind}: {size} bytes, at most {MAX_CONSTRAINT_BYTES} allowed"
        )
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except ValueError as exc:
            raise InvalidArgument(f"sampling.constraint.json_schema: must be JSON text: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidArgument("sampling.constraint.json_schema: must be a JSON Schema object")


def _check_bounds(sampling: common_pb2.SamplingParams) -> None:
    """Every scalar the request set, by the table's rule (strata/sampling.py's BOUNDS); an optional
    field left unset takes its default, which is in range."""
    for name, value in as_sent(sampling, BOUNDS).items():
        problem = out_of_bounds(name, value)
        if problem is not None:
            raise InvalidArgument(f"sampling.{name}: {value} {problem}")


def _check_processors(sampling: common_pb2.SamplingParams) -> None:
    """The OpenAI/vLLM processors' lists; token ids beyond the vocabulary are the worker's to refuse."""
    if len(sampling.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(
            f"sampling.logit_bias: {len(sampling.logit_bias)} entries, "
            f"at most {MAX_LOGIT_BIAS_ENTRIES} allowed"
        )
    for token, bias in sorted(sampling.logit_bias.items()):
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise InvalidArgument(f"sampling.logit_bias: token {token}'s bias {bias} must be in [-100, 100]")
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            f"sampling.stop_token_ids: {len(sampling.stop_token_ids)} ids, "
            f"at most {MAX_STOP_TOKEN_IDS} allowed"
        )


def _check_logprobs(sampling: common_pb2.SamplingParams) -> None:
    if sampling.top_logprobs and not sampling.logprobs:
        raise InvalidArgument(
            f"sampling.top_logprobs: {sampling.top_logprobs} needs sampling.logprobs set (or send 0)"
        )


def _check_request_id(request_id: str, max_chars: int) -> str:
    if len(request_id) > max_chars:
        raise InvalidArgument(f"request_id: {len(request_id)} characters, at most {max_chars} allowed")
    if not request_id.isprintable():
        raise InvalidArgument("request_id: must hold printable characters only")
    return request_id
