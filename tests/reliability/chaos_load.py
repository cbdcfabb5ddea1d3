"""The chaos soak's load: a load plan (chaos_plan.py) sent open-loop through the client SDK.

Each planned request leaves at its time whatever happened to the others, through one
AsyncStrataClient with a given retry policy: unary Generate or GenerateStream, greedy with ignore_eos
or sampled with a seed, cancelled by the client after some tokens, or with a short deadline. An
Outcome records how it ended (OK, CLIENT_CANCELLED when the client cancelled it, or the status
code's name), how long it took against its timeout, the answer's tokens, model and failover point,
what a stream delivered, and how many attempts the SDK made (`CountingClient`). A request still
open 10 s after its own timeout is abandoned and recorded as HUNG. This module must not judge
outcomes.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from strata.client import AsyncStrataClient, build_request

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from strata.retry import CallAttempts
    from strata.v1 import gateway_pb2
    from tests.reliability.chaos_plan import Planned

OK = "OK"
CLIENT_CANCELLED = "CLIENT_CANCELLED"
"""A stream the client cancelled itself (a CANCELLED status from the server is recorded as such)."""
HUNG = "HUNG"
HANG_GRACE_S = 10.0
SAMPLING_TEMPERATURE = 0.8


class CountingClient(AsyncStrataClient):
    """The SDK's asyncio client, counting the attempts it makes per request id."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attempts: Counter[str] = Counter()

    def _attempt(self, method: Callable[..., Any], request: Any, attempts: CallAttempts) -> Any:
        self.attempts[getattr(request, "request_id", "")] += 1
        return super()._attempt(method, request, attempts)


@dataclass
class Outcome:
    """How one planned request ended."""

    planned: Planned
    code: str = ""
    details: str = ""
    seconds: float = 0.0
    started: float = 0.0
    """time.monotonic() when it left."""
    tokens: list[int] = field(default_factory=list)
    """The answer's token_ids (the final message's, for a stream)."""
    streamed: list[int] = field(default_factory=list)
    """The token ids a stream's messages delivered, concatenated."""
    model: str = ""
    failover_at: int = 0
    fallback_reason: str = ""
    attempts: int = 0

    @property
    def late_s(self) -> float:
        """Seconds past its timeout at which it ended (negative: before)."""
        return self.seconds - self.planned.timeout_s


def _request(planned: Planned, prompt: str, model: str) -> gateway_pb2.GenerateRequest:
    sampled = planned.sampled
    return build_request(
        prompt,
        model=model,
        max_new_tokens=planned.max_new_tokens,
        temperature=SAMPLING_TEMPERATURE if sampled else 0.0,
        seed=planned.index if sampled else None,
        ignore_eos=not sampled,
        request_id=planned.request_id,
    )


def _take(outcome: Outcome, answer: gateway_pb2.GenerateResponse) -> None:
    outcome.code = OK
    outcome.tokens = list(answer.token_ids)
    outcome.model = answer.model
    outcome.failover_at = int(answer.failover_at_token)
    outcome.fallback_reason = answer.fallback_reason


async def _stream(client: CountingClient, planned: Planned, request: Any, outcome: Outcome) -> None:
    stream = client.send_stream(request, timeout=planned.timeout_s)
    try:
        async for message in stream:
            outcome.streamed.extend(message.token_ids)
            if message.HasField("final"):
                _take(outcome, message.final)
            elif planned.cancel_after and len(outcome.streamed) >= planned.cancel_after:
                outcome.code = CLIENT_CANCELLED
                return
    finally:
        await stream.aclose()  # type: ignore[attr-defined]  # an async generator: cancels the call


async def _one(client: CountingClient, planned: Planned, prompt: str, model: str) -> Outcome:
    outcome = Outcome(planned, started=time.monotonic())
    request = _request(planned, prompt, model)
    try:
        if planned.stream:
            await _stream(client, planned, request, outcome)
        else:
            _take(outcome, await client.send(request, timeout=planned.timeout_s))
    except grpc.aio.AioRpcError as error:
        outcome.code = error.code().name
        outcome.details = error.details() or ""
    outcome.seconds = time.monotonic() - outcome.started
    if not outcome.code:
        outcome.code = "NO_FINAL"  # a stream that ended without its summary message
    return outcome


async def run_load(
    address: str,
    plan: Sequence[Planned],
    prompts: Sequence[str],
    model: str,
    client_factory: Callable[[str], CountingClient],
    start: float,
) -> list[Outcome]:
    """Send every planned request at time.monotonic() == start + its at_s; one Outcome each, in order."""
    client = client_factory(address)
    try:

        async def timed(planned: Planned) -> Outcome:
            await asyncio.sleep(max(0.0, start + planned.at_s - time.monotonic()))
            left = time.monotonic()
            try:
                return await asyncio.wait_for(
                    _one(client, planned, prompts[planned.prompt], model), planned.timeout_s + HANG_GRACE_S
                )
            except TimeoutError:
                return Outcome(planned, code=HUNG, started=left, seconds=time.monotonic() - left)

        outcomes = await asyncio.gather(*(timed(planned) for planned in plan))
    finally:
        await client.close()
    for outcome in outcomes:
        outcome.attempts = client.attempts[outcome.planned.request_id]
    return list(outcomes)
