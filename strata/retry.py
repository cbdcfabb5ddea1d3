"""The client's retry policy and the pure decision of whether, and after how long, to retry a failed call.

A server that is overloaded (RESOURCE_EXHAUSTED) or briefly down (UNAVAILABLE) may say how long to
wait: a google.rpc.RetryInfo in the rich status ('grpc-status-details-bin' trailer) or gRPC pushback
('grpc-retry-pushback-ms' trailer, where a negative or malformed value means "do not retry"). Without
a hint the client backs off exponentially with jitter. A retry that could not start before the call's
overall deadline is not made. A stream is retried only before its first message: once part of the
answer reached the caller, a failure goes to the caller rather than being replayed. `CallAttempts`
applies these rules to one call, counting its attempts against its overall timeout, so that the sync
and asyncio clients of strata.client only make each attempt and wait. This module decides only: it
reads the clock but does no I/O, never sleeps and never calls a server, so every rule is tested
without one.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from strata.status import STATUS_DETAILS_KEY
from strata.status import retry_delay_s as rich_status_delay_s

if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import TypeAlias

    Trailers: TypeAlias = Iterable[tuple[str, str | bytes]] | None

PUSHBACK_KEY = "grpc-retry-pushback-ms"


@dataclass(frozen=True)
class RetryPolicy:
    """How a StrataClient retries calls the server refused for overload or unavailability."""

    max_attempts: int = 4
    """Attempts in all, the first included; 1 disables retries."""
    initial_backoff_s: float = 0.1
    """Wait before the second attempt when the server gave no hint."""
    backoff_multiplier: float = 2.0
    """Growth of the un-hinted wait per attempt."""
    max_backoff_s: float = 5.0
    """Cap on the un-hinted wait."""
    max_hinted_delay_s: float = 60.0
    """A server hint longer than this is not waited out: the failure goes to the caller instead."""
    jitter: float = 0.2
    """An un-hinted wait is drawn from [(1 - jitter) * backoff, backoff], so clients spread out."""
    retryable_codes: frozenset[grpc.StatusCode] = field(
        default_factory=lambda: frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
    )
    """Codes worth another attempt; every other code goes straight to the caller."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts} must be >= 1 (1 disables retries)")
        if min(self.initial_backoff_s, self.max_backoff_s, self.max_hinted_delay_s) < 0:
            raise ValueError("initial_backoff_s, max_backoff_s and max_hinted_delay_s must be >= 0")
        if self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier={self.backoff_multiplier} must be >= 1, e.g. 2.0")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter={self.jitter} must be within [0, 1], e.g. 0.2")


NO_RETRY = RetryPolicy(max_attempts=1)


def _values(metadata: Trailers, key: str) -> list[str | bytes]:
    return [value for name, value in metadata or () if name.lower() == key]


def retry_info_delay_s(metadata: Trailers) -> float | None:
    """The delay a google.rpc.RetryInfo in the rich-status trailer asks for, or None without one."""
    for value in _values(metadata, STATUS_DETAILS_KEY):
        delay = rich_status_delay_s(value if isinstance(value, bytes) else value.encode("latin-1"))
        if delay is not None:
            return max(0.0, delay)
    return None


def pushback_delay_s(metadata: Trailers) -> float | None:
    """The pushback delay in seconds; -1.0 when the server forbids retrying; None without a trailer.

    gRPC's retry design (A6) reads a negative or non-integer pushback as "do not retry".
    """
    for value in _values(metadata, PUSHBACK_KEY):
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        try:
            millis = int(text.strip())
        except ValueError:
            return -1.0
        return -1.0 if millis < 0 else millis / 1000.0
    return None


def backoff_s(policy: RetryPolicy, attempt: int, rng: random.Random | None = None) -> float:
    """The un-hinted wait after failed attempt number `attempt` (1-based): exponential, capped, jittered."""
    ceiling = min(policy.max_backoff_s, policy.initial_backoff_s * policy.backoff_multiplier ** (attempt - 1))
    draw = (rng or random).uniform(1.0 - policy.jitter, 1.0)
    return ceiling * draw


def retry_delay_s(
    policy: RetryPolicy,
    code: grpc.StatusCode | None,
    trailing_metadata: Trailers,
    attempt: int,
    time_left_s: float | None,
    rng: random.Random | None = None,
) -> float | None:
    """How long to wait before the next attempt, or None when the failure goes to the caller.

    `attempt` counts the attempts made so far (1 after the first failure); `time_left_s` is what is
    left of the call's overall timeout (None: no timeout). A hinted wait wins over backoff; when both
    hints are present the longer one is honoured, and a hint past max_hinted_delay_s is not waited.
    A wait that would reach the deadline is not started.
    """
    if code not in policy.retryable_codes or attempt >= policy.max_attempts:
        return None
    pushback = pushback_delay_s(trailing_metadata)
    if pushback is not None and pushback < 0:
        return None
    hints = [hint for hint in (retry_info_delay_s(trailing_metadata), pushback) if hint is not None]
    delay = max(hints) if hints else backoff_s(policy, attempt, rng)
    if hints and delay > policy.max_hinted_delay_s:
        return None
    if time_left_s is not None and delay >= time_left_s:
        return None
    return delay


def delay_for_error(
    policy: RetryPolicy,
    error: grpc.RpcError,
    attempt: int,
    time_left_s: float | None,
    rng: random.Random | None = None,
) -> float | None:
    """retry_delay_s for a raised grpc.RpcError, sync (a grpc.Call) or asyncio (grpc.aio.AioRpcError)."""
    if not isinstance(error, (grpc.aio.AioRpcError, grpc.Call)):
        return None
    code, trailers = error.code(), error.trailing_metadata()
    return retry_delay_s(policy, code, trailers, attempt, time_left_s, rng)


class CallAttempts:
    """The attempts of one call: what is left of its overall timeout, and after each failed attempt
    whether to try again and after how long."""

    def __init__(self, policy: RetryPolicy, timeout: float | None, rng: random.Random | None = None) -> None:
        """`timeout` bounds the whole call, every attempt and wait included (None: unbounded)."""
        self._policy = policy
        self._end = None if timeout is None else time.monotonic() + timeout
        self._rng = rng
        self._made = 0

    def time_left_s(self) -> float | None:
        """What is left of the call's timeout: the next attempt's own timeout (None: no timeout)."""
        return None if self._end is None else max(0.0, self._end - time.monotonic())

    def delay_after(self, error: grpc.RpcError, *, delivered: bool = False) -> float | None:
        """The wait before the next attempt after this one failed with `error`; None: give up.

        `delivered` says the attempt already handed the caller part of its answer (a stream's
        messages), which a retry would replay, so its failure goes to the caller.
        """
        self._made += 1
        if delivered:
            return None
        return delay_for_error(self._policy, error, self._made, self.time_left_s(), self._rng)
