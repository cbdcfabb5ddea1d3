"""Between the OpenAI API's shapes and the pipeline's: requests in, responses and stream chunks out.

`to_generate_request` turns a parsed body into the GenerateRequest the gRPC front door would pass,
with the OpenAI API's defaults (temperature 1, top_p 1, max_tokens from `http_default_max_tokens`
capped by max_new_tokens_limit and the model's context) instead of the gRPC ones; `response_format`
becomes the sampling's output constraint and `tools`/`tool_choice` the request's (openai_tools.py
renders a conversation's earlier calls and answers). `Reply` builds the response objects of one
request: the whole `chat.completion` or `text_completion`, each stream chunk, the usage (with the
prompt tokens the prefix cache served) and the final chunk's `strata` extension (who served it and
where the time went), plus the headers that say the same on a whole response. `http_param` names a
pipeline error's field as the client sent it (`max_tokens`, not `sampling.max_new_tokens`). This
module must not do I/O nor decide anything about admission: the pipeline validates and decides.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from gateway import openai_tools
from gateway.openai_logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from gateway.openai_schema import TABLE_FIELDS
from gateway.reasoning import ReasoningSplit
from gateway.request_ids import response_id
from gateway.stage_clock import STAGES
from gateway.tool_calls import answered_with_calls
from gateway.tool_stream import CallStart
from strata.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
    from gateway.settings import GatewaySettings
    from gateway.tool_stream import CallArguments

FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}
PRIORITIES = {"interactive": gateway_pb2.PRIORITY_INTERACTIVE, "batch": gateway_pb2.PRIORITY_BATCH}
TRUNCATIONS = {"refuse": gateway_pb2.TRUNCATION_REFUSE, "left": gateway_pb2.TRUNCATION_LEFT}
# The OpenAI API's newer name for the system role.
ROLE_ALIASES = {"developer": "system"}
_SAMPLING_PATH = re.compile(r"^sampling\.(\w+)")


def to_generate_request(
    body: ChatCompletionRequest | CompletionRequest,
    settings: GatewaySettings,
    context_limit: Callable[[str], int | None],
) -> gateway_pb2.GenerateRequest:
    """The pipeline's request for `body`; `context_limit(model)` is the model's context when known."""
    _, max_tokens = body.token_limit()
    if max_tokens is None:
        max_tokens = min(settings.http_default_max_tokens, settings.max_new_tokens_limit)
        context = context_limit(body.model or settings.default_route)
        if context is not None:
            max_tokens = max(1, min(max_tokens, context - 1))
    sampling = common_pb2.SamplingParams(
        max_new_tokens=max_tokens,
        stop=body.stops(),
        logit_bias=body.logit_bias_ids(),
        stop_token_ids=body.stop_token_ids or [],
        no_speculation=not body.speculate,
        **{name: value for name in TABLE_FIELDS if (value := getattr(body, name)) is not None},
    )
    top = body.top_alternatives()
    if top is not None:
        sampling.logprobs = True
        sampling.top_logprobs = top
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        openai_tools.set_constraint(sampling, response_format)
    request = gateway_pb2.GenerateRequest(
        model=body.model,
        sampling=sampling,
        allow_fallback=body.allow_fallback,
        no_fallback=body.no_fallback,
        priority=PRIORITIES[body.priority] if body.priority else gateway_pb2.PRIORITY_UNSPECIFIED,
        truncation=TRUNCATIONS[body.truncation] if body.truncation else gateway_pb2.TRUNCATION_UNSPECIFIED,
        n=body.n,
    )
    if hasattr(body, "messages"):
        for message in body.messages:
            calls = [
                common_pb2.ToolCall(id=c.id, name=c.function.name, arguments_json=c.function.arguments)
                for c in message.tool_calls or ()
            ]
            request.messages.add(
                role=ROLE_ALIASES.get(message.role, message.role),
                content=message.text(),
                tool_calls=calls,
                tool_call_id=message.tool_call_id or "",
            )
        openai_tools.set_tools(
            request,
            getattr(body, "tools", None),
            getattr(body, "tool_choice", None),
            getattr(body, "parallel_tool_calls", None),
        )
    else:
        request.prompt = body.prompt_text()
    return request


def http_param(message: str, token_field: str) -> str | None:
    """The request field a pipeline error names, in the HTTP API's names; None when it names none."""
    field, sep, _ = message.partition(":")
    if not sep or " " in field:
        return None
    match = _SAMPLING_PATH.match(field)
    if match is None:
        return field
    name = match.group(1)
    if name == "max_new_tokens":
        return token_field
    if name == "constraint":
        return "response_format"
    return field.removeprefix("sampling.")


def http_message(message: str, token_field: str) -> str:
    """The pipeline's message with its leading field path in the HTTP API's names."""
    param = http_param(message, token_field)
    field = message.partition(":")[0]
    return f"{param}{message[len(field) :]}" if param is not None and param != field else message


class Reply:
    """The OpenAI objects of one request's answer, for a chat or a text completion."""

    def __init__(
        self, chat: bool, request_model: str, sampling: common_pb2.SamplingParams | None = None
    ) -> None:
        """`sampling` (the request's) says whether choices carry log probabilities."""
        self.chat = chat
        self.created = int(time.time())
        self.model = request_model
        self.id = ""
        self.logprobs = sampling is not None and sampling.logprobs
        self.prompt_logprobs = sampling is not None and sampling.HasField("prompt_logprobs")
        self._text_offsets: dict[int, int] = {}
        """Per sample: where its next token starts in its text (the completions logprobs' text_offset)."""
        self.thinks = False
        """The model may open an answer with reasoning: a chat answer's goes to `reasoning_content`."""

    def started(self, request_id: str, model: str) -> None:
        """The request's id and serving model, as the first chunk tells them."""
        self.id = response_id(request_id, chat=self.chat)
        self.model = model

    def whole(self, final: gateway_pb2.GenerateResponse) -> dict[str, Any]:
        """The non-streaming response body: one choice, or with n > 1 every sample's."""
        self.started(final.request_id, final.model)
        samples = final.choices or [
            gateway_pb2.Choice(text=final.text, finish_reason=final.finish_reason, logprobs=final.logprobs)
        ]
        choices = []
        for sample in samples:
            finish = FINISH_REASONS.get(sample.finish_reason, "stop")
            choice: dict[str, Any] = {
                "index": sample.index,
                "finish_reason": finish,
                "logprobs": self._logprobs(sample.logprobs, sample.index),
            }
            if self.prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs(final.prompt_logprobs)
            if self.chat and final.tool_calls:  # tools take one sample
                choice["finish_reason"] = "tool_calls" if answered_with_calls(final) else "length"
                choice["message"] = {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": openai_tools.tool_calls(final, with_index=False),
                }
            elif self.chat:
                reasoning, answer = ReasoningSplit.split(sample.text, self.thinks)
                choice["message"] = {"role": "assistant", "content": answer}
                if reasoning:
                    choice["message"]["reasoning_content"] = reasoning
            else:
                choice["text"] = sample.text
            choices.append(choice)
        return {**self._head(), "choices": choices, "usage": usage(final)}

    def chunk(
        self,
        text: str,
        finish: str | None = None,
        first: bool = False,
        logprobs: Sequence[common_pb2.PositionLogprobs] = (),
        index: int = 0,
    ) -> dict[str, Any]:
        """One stream chunk of sample `index`: a text delta and its tokens' logprobs (the finish reason
        on the sample's last)."""
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": finish,
            "logprobs": self._logprobs(logprobs, index),
        }
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        return {**self._head(chunk=True), "choices": [choice]}

    def reasoning_chunk(self, text: str, first: bool, index: int = 0) -> dict[str, Any]:
        """A chat stream chunk of sample `index`'s reasoning (`delta.reasoning_content`)."""
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        delta["reasoning_content"] = text
        choice = {"index": index, "finish_reason": None, "logprobs": None, "delta": delta}
        return {**self._head(chunk=True), "choices": [choice]}

    def call_chunk(self, piece: CallStart | CallArguments) -> dict[str, Any]:
        """The stream chunk of a call's start (its id and name) or of a fragment of its arguments."""
        if isinstance(piece, CallStart):
            entry: dict[str, Any] = {
                "index": piece.index,
                "id": piece.id,
                "type": "function",
                "function": {"name": piece.name, "arguments": ""},
            }
        else:
            entry = {"index": piece.index, "function": {"arguments": piece.text}}
        choice = {"index": 0, "finish_reason": None, "logprobs": None, "delta": {"tool_calls": [entry]}}
        return {**self._head(chunk=True), "choices": [choice]}

    def empty_chunk(self) -> dict[str, Any]:
        """A chunk with no choices: what ends a stream of n > 1 samples (every one has finished)."""
        return {**self._head(chunk=True), "choices": []}

    def _logprobs(
        self, positions: Sequence[common_pb2.PositionLogprobs], index: int
    ) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(positions)
        offset = self._text_offsets.get(index, 0)
        self._text_offsets[index] = offset + sum(len(p.chosen.token) for p in positions)
        return completion_logprobs(positions, offset)

    def usage_chunk(self, final: gateway_pb2.GenerateResponse) -> dict[str, Any]:
        """The last chunk of a stream that asked for `include_usage`: no choices, the usage."""
        return {**self._head(chunk=True), "choices": [], "usage": usage(final)}

    def _head(self, chunk: bool = False) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(final: gateway_pb2.GenerateResponse) -> dict[str, Any]:
    """OpenAI's usage object. With n > 1 the final's usage is the whole request's (samples.py): the
    prompt once, with the cached tokens of the sample that prefilled it, and every sample's output.
    Speculative decoding's drafts take OpenAI's predicted-output counts: the drafts the model kept are
    accepted, the rest rejected."""
    counts = final.usage
    prompt, completion = counts.input_tokens, counts.output_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": counts.cached_input_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": counts.accepted_draft_tokens,
            "rejected_prediction_tokens": counts.draft_tokens - counts.accepted_draft_tokens,
        },
    }


def server_timing(timing: common_pb2.Timing) -> str:
    """The W3C Server-Timing value: each stage's milliseconds, then the total."""
    parts = [f"{stage};dur={getattr(timing, f'{stage}_ms'):.3f}" for stage in STAGES]
    return ", ".join([*parts, f"total;dur={timing.total_ms:.3f}"])


def extension(final: gateway_pb2.GenerateResponse) -> dict[str, Any]:
    """The final stream chunk's `strata` object: what a whole response's headers carry, and more."""
    timing = final.timing
    return {
        "request_id": final.request_id,
        "trace_id": final.trace_id,
        "fallback_reason": final.fallback_reason,
        "failover_at_token": final.failover_at_token,
        "server_timing": server_timing(timing),
        "timing_ms": {
            "time_to_first_token": timing.time_to_first_token_ms,
            "total": timing.total_ms,
            **{stage: getattr(timing, f"{stage}_ms") for stage in STAGES},
        },
    }


def headers(final: gateway_pb2.GenerateResponse) -> dict[str, str]:
    """A whole response's headers: who served it, why a fallback, its trace, where the time went."""
    return {
        "x-request-id": _header_safe(final.request_id),
        "x-strata-trace-id": final.trace_id,
        "x-strata-fallback-reason": _header_safe(final.fallback_reason),
        "server-timing": server_timing(final.timing),
    }


def _header_safe(value: str) -> str:
    """`value` as a header may carry it: printable ASCII (a reason may quote a model's name)."""
    return "".join(c if " " <= c <= "~" else "?" for c in value)
