"""The fallback policy: given a request, its primary route's state and the route's fallback, where the
request goes and the reason its client reads in `fallback_reason`.

Four triggers send a request to the route's fallback (a smaller model with the same tokenizer):
1. the primary is unavailable (no ready worker: unreachable or NOT_SERVING);
2. the primary is saturated (queue full, token budget, predicted time to first token over the SLO) and
   the request set `allow_fallback`; without it the primary refuses with RESOURCE_EXHAUSTED;
3. the primary failed the request before its first token (a crash, a rejection, an engine error);
4. the primary died mid-stream: the fallback continues the generation from the tokens the client
   already received, which is only sound when both routes tokenize with the same tokenizer.
Triggers 1, 3 and 4 apply by default; none applies when the route has no fallback, turns it off
(`fallback_enabled: false`) or the request sets `no_fallback`. A request goes to the fallback at most
once: the fallback's own failures reach the client. This module must not do I/O nor await anything:
the pipeline asks it and acts on the answer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway.errors import Unavailable

if TYPE_CHECKING:
    from strata.v1 import gateway_pb2


class Trigger(enum.StrEnum):
    """Why a request left its primary; the `reason` label of strata_gateway_fallbacks_total."""

    UNAVAILABLE = "primary_unavailable"
    SATURATED = "primary_saturated"
    FAILED = "primary_failed"
    FAILOVER = "failover"


class RouteConfig(Protocol):
    """What the policy reads from a route (gateway.route.Route has it)."""

    @property
    def name(self) -> str: ...
    @property
    def fallback(self) -> str: ...
    @property
    def fallback_enabled(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Detour:
    """Serve the request from the fallback route."""

    route: str
    """The fallback route's name."""
    trigger: Trigger
    reason: str
    """The GenerateResponse.fallback_reason."""


@dataclass(frozen=True, slots=True)
class FallbackPolicy:
    """One request's fallback rules, from its route's settings and its own flags."""

    primary: str
    fallback: str
    """The fallback route's name; empty when the route has none."""
    fallback_enabled: bool
    allow_fallback: bool
    """The request may leave a saturated primary."""
    no_fallback: bool
    """The request must never leave its primary."""

    @classmethod
    def of(cls, route: RouteConfig, request: gateway_pb2.GenerateRequest) -> FallbackPolicy:
        return cls(
            primary=route.name,
            fallback=route.fallback,
            fallback_enabled=route.fallback_enabled,
            allow_fallback=request.allow_fallback,
            no_fallback=request.no_fallback,
        )

    @property
    def usable(self) -> bool:
        """Whether the fallback may serve this request on any trigger."""
        return self.blocker() is None

    def blocker(self, trigger: Trigger = Trigger.UNAVAILABLE) -> str | None:
        """Why the fallback may not take this request on `trigger`; None when it may."""
        if not self.fallback:
            return f"route {self.primary!r} has no fallback model"
        if not self.fallback_enabled:
            return f"fallback is turned off for route {self.primary!r}"
        if self.no_fallback:
            return "the request set no_fallback"
        if trigger is Trigger.SATURATED and not self.allow_fallback:
            return "the request did not set allow_fallback"
        return None

    def when_unavailable(self, reason: str, fallback_ready: bool, fallback_reason: str = "") -> Detour:
        """Trigger 1; raises Unavailable naming why neither route can serve."""
        message = f"model {self.primary!r} is unavailable: {reason}"
        blocker = self.blocker(Trigger.UNAVAILABLE)
        if blocker is not None:
            raise Unavailable(self._suffix(message, blocker))
        if not fallback_ready:
            raise Unavailable(
                f"{message}; its fallback {self.fallback!r} is unavailable too: {fallback_reason}"
            )
        return Detour(self.fallback, Trigger.UNAVAILABLE, f"primary {self.primary} unavailable: {reason}")

    def when_saturated(self, saturation: str, fallback_free: bool) -> Detour | None:
        """Trigger 2: the detour, or None when the primary must refuse the request.

        `fallback_free` says the fallback is ready and not saturated itself: a request is never sent
        from one full queue to another.
        """
        if self.blocker(Trigger.SATURATED) is not None or not fallback_free:
            return None
        return Detour(self.fallback, Trigger.SATURATED, f"primary saturated: {saturation}")

    def when_failed(self, reason: str, received_tokens: int, obstacle: str | None = None) -> Detour:
        """Triggers 3 (no token yet) and 4 (mid-stream); raises Unavailable saying how many tokens the
        client received when the request may not go on on the fallback.

        `obstacle` says why the fallback cannot continue this stream (another tokenizer, a shorter
        context); it only matters mid-stream, since a request with no token yet starts afresh.
        """
        if received_tokens == 0:
            message = f"model {self.primary!r} failed the request before its first token: {reason}"
            blocker = self.blocker(Trigger.FAILED)
            if blocker is not None:
                raise Unavailable(f"{self._suffix(message, blocker)}; {received(0)}")
            return Detour(self.fallback, Trigger.FAILED, f"primary failed before the first token: {reason}")
        message = f"model {self.primary!r} failed mid-stream after {received_tokens} tokens: {reason}"
        blocker = self.blocker(Trigger.FAILOVER) or obstacle
        if blocker is not None:
            raise Unavailable(f"{self._suffix(message, blocker)}; {received(received_tokens)}")
        return Detour(
            self.fallback,
            Trigger.FAILOVER,
            f"primary {self.primary} failed mid-stream after {received_tokens} tokens: {reason}",
        )

    def _suffix(self, message: str, blocker: str) -> str:
        return message if not self.fallback else f"{message}; not sent to the fallback: {blocker}"


def received(count: int) -> str:
    """How much of the answer the client holds, for the message of a stream that ends early."""
    if count == 0:
        return "the client received no tokens"
    return f"the client received {count} token{'s' if count != 1 else ''} before the failure"
