"""Log probabilities in the OpenAI API's shapes: chat's `logprobs.content` and the legacy completions
object, plus vLLM's `prompt_logprobs`.

Chat (`choices[i].logprobs`): {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
"refusal": null}, where bytes are the token's UTF-8 bytes as a list of ints. Completions:
{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}. prompt_logprobs, as
vLLM returns it: null for the first prompt token, then per token {id: {"logprob", "rank",
"decoded_token"}} for the prompt's token and its alternatives. This module must not do I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from strata.v1 import common_pb2


def _token(token: common_pb2.TokenLogprob) -> dict[str, Any]:
    return {"token": token.token, "logprob": token.logprob, "bytes": list(token.token_bytes)}


def chat_logprobs(positions: Sequence[common_pb2.PositionLogprobs]) -> dict[str, Any]:
    """A chat choice's (or stream delta's) `logprobs` object."""
    content = [{**_token(p.chosen), "top_logprobs": [_token(top) for top in p.top]} for p in positions]
    return {"content": content, "refusal": None}


def completion_logprobs(positions: Sequence[common_pb2.PositionLogprobs], offset: int) -> dict[str, Any]:
    """A text completion's `logprobs` object; `offset` is the first token's place in the text."""
    offsets: list[int] = []
    for p in positions:
        offsets.append(offset)
        offset += len(p.chosen.token)
    return {
        "tokens": [p.chosen.token for p in positions],
        "token_logprobs": [p.chosen.logprob for p in positions],
        # Two alternatives with the same text keep the likelier one, as OpenAI's dict does.
        "top_logprobs": [{t.token: t.logprob for t in reversed(p.top)} for p in positions],
        "text_offset": offsets,
    }


def prompt_logprobs(positions: Sequence[common_pb2.PositionLogprobs]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, which nothing predicts."""
    out: list[dict[str, Any] | None] = [None]
    for p in positions:
        entry = {
            str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
            for rank, t in enumerate(p.top, start=1)
        }
        entry[str(p.chosen.token_id)] = {
            "logprob": p.chosen.logprob,
            "rank": p.rank,
            "decoded_token": p.chosen.token,
        }
        out.append(entry)
    return out
