"""One benchmark request over the gateway's HTTP APIs, and what the client saw of it.

It POSTs a streaming /v1/completions (the prompt text, greedy, EOS ignored, `include_usage`; `body`)
or /v1/chat/completions (one user message, greedy; `chat_body`, EOS ending it unless `ignore_eos`),
Anthropic's /v1/messages (`messages_body`, the same message; read by `send_messages`) or OpenAI's
/v1/responses (`responses_body`, the same message; read by `send_responses`) through httpx2's
async client, the cheapest well-kept HTTP client Python has, reads the Server-Sent Events as they arrive
and stamps each one: the first event with text is the first token (the gateway sends no chunk
without text), the usage chunk gives the token counts and speculative decoding's kept and rejected
drafts (an HTTP chunk carries text, not token ids, so the text is kept whole). The record is
bench/driver.py's
RequestResult, so both protocols' results reduce the same way. This module owns the request; it must
not schedule requests nor reduce results (bench/http_vs_grpc.py does).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from bench.driver import RequestResult

if TYPE_CHECKING:
    from collections.abc import Callable

    import httpx2

    from bench.stack_prompts import Prompt

DATA = "data: "


def body(prompt: Prompt, new_tokens: int, model: str) -> dict[str, object]:
    """The same request bench/driver.py's make_request sends over gRPC, in the HTTP API's names."""
    return {
        "model": model,
        "prompt": prompt.text,
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chat_body(message: str, new_tokens: int, model: str, *, ignore_eos: bool = False) -> dict[str, object]:
    """One user message, greedy, up to `new_tokens` tokens (EOS may end it sooner unless
    `ignore_eos`), streamed."""
    payload: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # Strata's own field: sent only when asked for
        payload["ignore_eos"] = True
    return payload


def messages_body(message: str, new_tokens: int, model: str) -> dict[str, object]:
    """chat_body's request with EOS ignored, in the Messages API's names."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def responses_body(message: str, new_tokens: int, model: str) -> dict[str, object]:
    """chat_body's request with EOS ignored, in the Responses API's names (stored, as by default)."""
    return {
        "model": model,
        "input": message,
        "max_output_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def chunk_text(choice: dict[str, Any]) -> str:
    """A stream chunk's text: a completion's `text`, a chat completion's `delta.content`."""
    return str(choice.get("text") or choice.get("delta", {}).get("content") or "")


def _text_arrived(result: RequestResult, text: str, sent: float, previous: float, arrived: float) -> float:
    """Stamp an event's `text` on `result` (the first text is the first token, later ones a gap);
    returns when the last text came."""
    if not text:
        return previous
    result.text += text
    if result.ttft_s is None:
        result.ttft_s = result.first_text_s = arrived - sent
    else:
        result.itl_s.append(arrived - previous)
    return arrived


async def send_http(
    client: httpx2.AsyncClient, url: str, index: int, payload: dict[str, object], timeout_s: float
) -> RequestResult:
    """POST `payload` to `url` and read its event stream to the end."""
    sent = time.perf_counter()
    result = RequestResult(index=index, status="OK", ttft_s=None, e2e_s=0.0)
    previous = sent
    async with client.stream("POST", url, json=payload, timeout=timeout_s) as response:
        if response.status_code != 200:
            await response.aread()
            result.status, result.message = str(response.status_code), response.text
        else:
            async for line in response.aiter_lines():
                if not line.startswith(DATA) or line == "data: [DONE]":
                    continue
                arrived = time.perf_counter()
                chunk = json.loads(line.removeprefix(DATA))
                if "error" in chunk:
                    result.status, result.message = "STREAM_ERROR", chunk["error"]["message"]
                    break
                text = chunk_text(chunk["choices"][0]) if chunk["choices"] else ""
                previous = _text_arrived(result, text, sent, previous, arrived)
                if usage := chunk.get("usage"):
                    result.usage_input_tokens = usage["prompt_tokens"]
                    result.usage_output_tokens = usage["completion_tokens"]
                    result.model = chunk["model"]
                    # Servers that do not speculate (llama.cpp's, say) leave the details out: no drafts.
                    drafts = usage.get("completion_tokens_details") or {}
                    result.accepted_draft_tokens = drafts.get("accepted_prediction_tokens", 0)
                    result.draft_tokens = result.accepted_draft_tokens + drafts.get(
                        "rejected_prediction_tokens", 0
                    )
    result.e2e_s = time.perf_counter() - sent
    return result


async def send_messages(
    client: httpx2.AsyncClient, url: str, index: int, payload: dict[str, object], timeout_s: float
) -> RequestResult:
    """POST `payload` to a Messages API `url` and read its named events to the end: the text deltas,
    and the token counts of message_delta (the prompt's: computed plus read from the prefix cache)."""

    def read(event: dict[str, Any], result: RequestResult) -> str | None:
        kind = event["type"]
        if kind == "error":
            result.status, result.message = "STREAM_ERROR", event["error"]["message"]
            return None
        if kind == "message_delta":
            usage = event["usage"]
            result.usage_input_tokens = usage["input_tokens"] + usage["cache_read_input_tokens"]
            result.usage_output_tokens = usage["output_tokens"]
        return event["delta"].get("text", "") if kind == "content_block_delta" else ""

    headers = {"anthropic-version": "2023-06-01"}
    return await _send_events(client, url, index, payload, timeout_s, read, headers)


async def send_responses(
    client: httpx2.AsyncClient, url: str, index: int, payload: dict[str, object], timeout_s: float
) -> RequestResult:
    """POST `payload` to a Responses API `url` and read its named events to the end: the text deltas,
    and the token counts of the response that ends the stream."""

    def read(event: dict[str, Any], result: RequestResult) -> str | None:
        kind = event["type"]
        if kind == "error":
            result.status, result.message = "STREAM_ERROR", event["message"]
            return None
        if kind in ("response.completed", "response.incomplete"):
            usage = event["response"]["usage"]
            result.usage_input_tokens = usage["input_tokens"]
            result.usage_output_tokens = usage["output_tokens"]
        return str(event["delta"]) if kind == "response.output_text.delta" else ""

    return await _send_events(client, url, index, payload, timeout_s, read, {})


async def _send_events(
    client: httpx2.AsyncClient,
    url: str,
    index: int,
    payload: dict[str, object],
    timeout_s: float,
    read: Callable[[dict[str, Any], RequestResult], str | None],
    headers: dict[str, str],
) -> RequestResult:
    """POST `payload` and read its stream of named events: `read` takes each event's counts into the
    result and answers its text, or None for an error that ends the stream."""
    sent = time.perf_counter()
    result = RequestResult(index=index, status="OK", ttft_s=None, e2e_s=0.0)
    previous = sent
    async with client.stream("POST", url, json=payload, headers=headers, timeout=timeout_s) as response:
        if response.status_code != 200:
            await response.aread()
            result.status, result.message = str(response.status_code), response.text
        else:
            async for line in response.aiter_lines():
                if not line.startswith(DATA):
                    continue
                arrived = time.perf_counter()
                text = read(json.loads(line.removeprefix(DATA)), result)
                if text is None:
                    break
                previous = _text_arrived(result, text, sent, previous, arrived)
    result.e2e_s = time.perf_counter() - sent
    return result
