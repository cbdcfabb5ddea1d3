"""One `strata bench` request over GenerateStream, and the record of what the client saw of it.

Both load shapes send their requests through `send`: the closed loop (bench/load.py: N streams, each
sending its next request when the previous one finished) and the open loop (bench/rate.py: requests
leave on a schedule). It talks to the gateway through the raw grpc.aio stub, the cheapest client
Python has, and stamps every message on arrival; a call may carry metadata (the API key that names
its tenant). A failed call keeps its status code, message and retry hint; a finished one keeps what
its final message said (usage with speculative decoding's drafts, serving model, fallback).
This module owns the request and its result; it must not schedule requests, start or stop a stack,
nor reduce results to figures (the load shapes and the reports do).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from strata.retry import pushback_delay_s, retry_info_delay_s
from strata.status import elapsed_s
from strata.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from collections.abc import Sequence

    from bench.stack_prompts import Prompt
    from strata.v1 import gateway_pb2_grpc

    Stub = gateway_pb2_grpc.GatewayAsyncStub
    Metadata = tuple[tuple[str, str], ...]
    """Call metadata, e.g. strata.client.auth_metadata's `authorization: Bearer <key>`."""


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request; times in seconds from its send."""

    index: int
    status: str
    """"OK", or the gRPC status code's name."""
    ttft_s: float | None
    e2e_s: float
    itl_s: list[float] = field(default_factory=list)
    """The inter-token gaps (see `token_timing`)."""
    token_ids: list[int] = field(default_factory=list)
    usage_input_tokens: int | None = None
    usage_output_tokens: int | None = None
    send_lag_s: float = 0.0
    """How late the client sent it against its schedule (its own event loop's lag); 0 without one."""
    message: str = ""
    """The status message of a failed call."""
    retry_hint_s: float | None = None
    server_elapsed_s: float | None = None
    """A failed call's own time in the gateway, arrival to failure (its strata-elapsed-ms trailer)."""
    """RetryInfo (or pushback) delay of a failed call; None when it carried none."""
    first_text_s: float | None = None
    """Time to the first message with text (a first token may make none: part of a character)."""
    model: str = ""
    """The model that served it, as the final message says."""
    fallback_reason: str = ""
    failover_at_token: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    """Speculative decoding's drafts for it and those kept, as its final message's usage says."""
    text: str = ""
    """Over HTTP, the text it received (its chunks carry no token ids); empty over gRPC."""


def token_timing(sent: float, arrivals: Sequence[tuple[float, int]]) -> tuple[float | None, list[float]]:
    """Time to first token and the inter-token gaps, from (arrival time, tokens in message) pairs.

    A message carrying k tokens counts as k gaps of (its arrival - the previous token message's) / k:
    the stack may coalesce tokens, and a per-message gap would overstate each token's wait k-fold.
    The tokens that share the first message have no gap of their own (their wait is in the TTFT).
    Messages without tokens (a partial character, the final summary) are skipped.
    """
    ttft: float | None = None
    previous = sent
    gaps: list[float] = []
    for arrived, count in arrivals:
        if count <= 0:
            continue
        if ttft is None:
            ttft = arrived - sent
        else:
            gaps.extend([(arrived - previous) / count] * count)
        previous = arrived
    return ttft, gaps


def make_request(
    prompt: Prompt, new_tokens: int, request_id: str, model: str = ""
) -> gateway_pb2.GenerateRequest:
    """Raw text, greedy, EOS ignored: every request generates exactly `new_tokens` tokens."""
    sampling = common_pb2.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return gateway_pb2.GenerateRequest(
        prompt=prompt.text, model=model, sampling=sampling, request_id=request_id
    )


async def send(
    stub: Stub,
    index: int,
    request: gateway_pb2.GenerateRequest,
    timeout_s: float,
    *,
    due: float | None = None,
    metadata: Metadata | None = None,
) -> RequestResult:
    """Send `request` now and read its stream to the end; `due` is when its schedule wanted it sent,
    `metadata` the call's metadata (an API key naming the tenant, say; None: none)."""
    arrivals: list[tuple[float, int]] = []
    sent = time.perf_counter()
    lag = max(0.0, sent - due) if due is not None else 0.0
    result = RequestResult(index=index, status="OK", ttft_s=None, e2e_s=0.0, send_lag_s=lag)
    try:
        async for message in stub.GenerateStream(request, timeout=timeout_s, metadata=metadata):
            arrived = time.perf_counter()
            if message.text and result.first_text_s is None:
                result.first_text_s = arrived - sent
            if message.token_ids:
                arrivals.append((arrived, len(message.token_ids)))
                result.token_ids.extend(message.token_ids)
            if message.HasField("final"):
                final = message.final
                result.model, result.fallback_reason = final.model, final.fallback_reason
                result.failover_at_token = final.failover_at_token
                result.usage_input_tokens = final.usage.input_tokens
                result.usage_output_tokens = final.usage.output_tokens
                result.draft_tokens = final.usage.draft_tokens
                result.accepted_draft_tokens = final.usage.accepted_draft_tokens
    except grpc.aio.AioRpcError as exc:
        result.status, result.message = exc.code().name, exc.details() or ""
        trailers = list(exc.trailing_metadata() or ())
        hints = [h for h in (retry_info_delay_s(trailers), pushback_delay_s(trailers)) if h is not None]
        result.retry_hint_s = max(hints) if hints else None
        result.server_elapsed_s = elapsed_s(trailers)
    result.e2e_s = time.perf_counter() - sent
    result.ttft_s, result.itl_s = token_timing(sent, arrivals)
    return result
