"""`build_request`: the strata.v1 GenerateRequest for plain Python arguments, as the clients send it.

strata.client's `generate` and `generate_stream` and the command line's `strata generate` build their
requests here, so a keyword means the same on every path; None leaves an optional field unset, so the
gateway applies its default. This module only converts: it must not call the gateway, nor validate
what the gateway validates (prompt vs. messages, limits): the gateway answers INVALID_ARGUMENT naming
the field. A chat message or truncation it cannot express raises ValueError.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from strata.sampling import SamplingOptions
from strata.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from typing_extensions import Unpack


def _chat_message(message: tuple[str, str] | Mapping[str, str]) -> common_pb2.ChatMessage:
    if isinstance(message, tuple) and len(message) == 2:
        return common_pb2.ChatMessage(role=message[0], content=message[1])
    if not isinstance(message, tuple) and "role" in message and "content" in message:
        return common_pb2.ChatMessage(role=message["role"], content=message["content"])
    raise ValueError(
        f"a chat message is a (role, content) tuple or a {{'role', 'content'}} dict, not {message!r}"
    )


def _truncation(value: int | str | None) -> gateway_pb2.Truncation.ValueType:
    if value is None:
        return gateway_pb2.TRUNCATION_UNSPECIFIED
    for name, number in gateway_pb2.Truncation.items():
        short = name.removeprefix("TRUNCATION_")
        if value == number or (isinstance(value, str) and value.upper() in (name, short)):
            return number
    choices = ", ".join(
        name.removeprefix("TRUNCATION_").lower() for name, _ in gateway_pb2.Truncation.items()
    )
    raise ValueError(f"truncation={value!r} is not one of {choices}")


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[tuple[str, str] | Mapping[str, str]] | None = None,
    model: str = "",
    stop: Sequence[str] = (),
    request_id: str = "",
    allow_fallback: bool = False,
    truncation: int | str | None = None,
    logit_bias: Mapping[int, float] | None = None,
    stop_token_ids: Sequence[int] = (),
    logprobs: int | None = None,
    n: int = 1,
    json_schema: str | Mapping[str, Any] | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    speculate: bool = True,
    **options: Unpack[SamplingOptions],
) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest for these arguments; None leaves an optional field unset (the server's default).

    `messages` are (role, content) tuples or {"role", "content"} dicts; `truncation` is a
    gateway_pb2.Truncation value or its name ("left", "refuse"). `options` are the scalar sampling
    parameters under their proto names (strata.sampling.SamplingOptions: max_new_tokens, temperature,
    top_p, ...). `logprobs` N returns each generated token's log probability with its N most likely
    alternatives (0: the token's alone); None: none. `n` samples of the prompt come back as the
    response's choices. At most one output constraint: `json_schema` (a dict, or its JSON text),
    `json_object`, `regex`, or `grammar` (Lark). `speculate` False keeps the request out of the
    worker's speculative decoding.
    """
    unknown = sorted(set(options) - set(SamplingOptions.__annotations__))
    if unknown:
        raise TypeError(f"build_request() got unexpected keyword arguments: {', '.join(unknown)}")
    sampling = common_pb2.SamplingParams(
        stop=list(stop),
        logit_bias=dict(logit_bias or {}),
        stop_token_ids=list(stop_token_ids),
        no_speculation=not speculate,
    )
    for name, value in options.items():
        if value is not None:
            setattr(sampling, name, value)
    if logprobs is not None:
        sampling.logprobs = True
        sampling.top_logprobs = logprobs
    constraints = {
        "json_schema": json_schema if isinstance(json_schema, str | None) else json.dumps(dict(json_schema)),
        "json_object": json_object or None,
        "regex": regex,
        "lark_grammar": grammar,
    }
    given = {kind: value for kind, value in constraints.items() if value is not None}
    if len(given) > 1:
        raise ValueError(f"at most one output constraint, not {', '.join(given)}")
    for kind, value in given.items():
        setattr(sampling.constraint, kind, value)
    return gateway_pb2.GenerateRequest(
        prompt=prompt or "",
        messages=[_chat_message(message) for message in messages or ()],
        model=model,
        sampling=sampling,
        request_id=request_id,
        allow_fallback=allow_fallback,
        truncation=_truncation(truncation),
        n=n,
    )
