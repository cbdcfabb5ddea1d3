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

from strata.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


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
    max_new_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int = 0,
    stop: Sequence[str] = (),
    seed: int | None = None,
    ignore_eos: bool = False,
    request_id: str = "",
    allow_fallback: bool = False,
    truncation: int | str | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    min_p: float = 0.0,
    typical_p: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    stop_token_ids: Sequence[int] = (),
    min_tokens: int = 0,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    n: int = 1,
    json_schema: str | Mapping[str, Any] | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    speculate: bool = True,
) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest for these arguments; None leaves an optional field unset (the server's default).

    `messages` are (role, content) tuples or {"role", "content"} dicts; `truncation` is a
    gateway_pb2.Truncation value or its name ("left", "refuse"). `logprobs` N returns each generated
    token's log probability with its N most likely alternatives (0: the token's alone); None: none.
    `prompt_logprobs` likewise for the prompt's tokens. `n` samples of the prompt come back as the
    response's choices. At most one output constraint: `json_schema` (a dict, or its JSON text),
    `json_object`, `regex`, or `grammar` (Lark). `speculate` False keeps the request out of the
    worker's speculative decoding.
    """
    sampling = common_pb2.SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        no_repeat_ngram_size=no_repeat_ngram_size,
        stop=list(stop),
        ignore_eos=ignore_eos,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        min_p=min_p,
        logit_bias=dict(logit_bias or {}),
        stop_token_ids=list(stop_token_ids),
        min_tokens=min_tokens,
        no_speculation=not speculate,
    )
    if logprobs is not None:
        sampling.logprobs = True
        sampling.top_logprobs = logprobs
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    if top_p is not None:
        sampling.top_p = top_p
    if typical_p is not None:
        sampling.typical_p = typical_p
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    if seed is not None:
        sampling.seed = seed
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
