"""A route: one model's worker links, its admission queue, and the dispatcher that hands out their credits.

A request passes one door per route. `Route.enqueue` decides at once, without awaiting anything:
UNAVAILABLE when no link is ready, a grant when a credit is free and nobody waits ahead, else a
place in the bounded queue, or a Refused (RESOURCE_EXHAUSTED with the reason and the predicted wait
as retry hint) when the route is saturated (admission.py). The caller tokenizes while it waits, then
awaits `Admission.granted`. The dispatcher runs whenever a link's credits or readiness change (each
worker message carries credits) and when a ticket arrives: it grants the waiting tickets in priority
order to the ready link with the most credit, least loaded first, reserving one credit per grant, so a
worker is never sent more than it accepts. Tickets granted in one pass are submitted in one event-loop
tick and so share one ConnectRequest. A ticket whose deadline passes while it waits leaves the queue
with DEADLINE_EXCEEDED (nothing was sent to a worker); a cancelled caller leaves it too. This module
must not talk to workers (worker_link.py) nor find them (discovery.py) nor validate requests.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.admission import Admission, AdmissionQueue, Refused, Ticket, Waiter, predicted_wait_s
from gateway.discovery import Discovery, resolve
from gateway.errors import DeadlineExceeded, Unavailable
from gateway.metrics import ADMISSION_DECISION_SECONDS, REJECTIONS

if TYPE_CHECKING:
    from collections.abc import Callable

    from gateway.discovery import Resolver
    from gateway.settings import GatewaySettings, RouteSettings
    from gateway.worker_link import WorkerLink

    MakeLink = Callable[[str, str, Callable[[], None]], WorkerLink]
    """(address, model, on_capacity) -> a new link."""

# A ticket leaves the queue this long before its deadline, so that the gateway's DEADLINE_EXCEEDED,
# which says how long it waited, reaches the client before the client's own timer fires.
EXPIRY_MARGIN_S = 0.02


@dataclass(frozen=True, slots=True)
class RouteStatus:
    """A route's state as ListModels reports it."""

    model: str
    max_model_len: int
    ready_workers: int
    configured_workers: int
    queued_requests: int


@dataclass(slots=True)
class _Verdict:
    """What admission would do with a ticket now."""

    victims: list[Waiter] = field(default_factory=list)
    wait_s: float | None = None
    reason: str = ""
    text: str = ""


class Route:
    """One model: its links, its admission queue and its dispatcher."""

    def __init__(
        self,
        settings: RouteSettings,
        gateway: GatewaySettings,
        make_link: MakeLink,
        on_change: Callable[[], None],
        resolver: Resolver = resolve,
    ) -> None:
        self.settings = settings
        self.name = settings.model
        self.fallback = settings.fallback
        self.fallback_enabled = settings.fallback_enabled
        self._default_retry_s = gateway.overload_retry_after_s
        self._queue = AdmissionQueue(settings.max_queued_requests, settings.max_queued_tokens)
        self._discovery = Discovery(
            settings,
            lambda address: make_link(address, self.name, self._capacity_changed),
            on_change,
            resolver,
        )

    @property
    def links(self) -> list[WorkerLink]:
        return list(self._discovery.links.values())

    @property
    def queued_requests(self) -> int:
        return self._queue.requests

    @property
    def queued_tokens(self) -> int:
        return self._queue.tokens

    def start(self) -> None:
        self._discovery.start()

    async def close(self) -> None:
        await self._discovery.close()
        self._fail_waiting(Unavailable(f"the gateway stopped serving model {self.name!r}"))

    def available(self) -> bool:
        """Some link is connected, serving and taking requests."""
        return any(link.ready and not link.retiring for link in self.links)

    def unavailable_reason(self) -> str:
        links = self.links
        if not links:
            found = self._discovery.last_error or "no worker address is known yet"
            return f"no worker is ready for model {self.name!r}: {found}"
        reasons = "; ".join(link.not_ready_reason for link in links)
        return f"no worker is ready for model {self.name!r}: {reasons}"

    def max_model_len(self) -> int | None:
        """The context length a worker of the route reported; None before any connected."""
        for link in self.links:
            if link.info is not None:
                return int(link.info.max_model_len)
        return None

    def status(self) -> RouteStatus:
        links = self.links
        return RouteStatus(
            model=self.name,
            max_model_len=self.max_model_len() or 0,
            ready_workers=sum(1 for link in links if link.ready),
            configured_workers=len(links),
            queued_requests=self.queued_requests,
        )

    def free_credits(self) -> int:
        return sum(link.credits for link in self.links)

    def per_grant_s(self) -> float | None:
        """Seconds between freed credits at full load (Little's law over the ready links)."""
        rate = 0.0
        for link in self.links:
            service = link.ledger.service_s
            if link.ready and link.info is not None and service:
                rate += link.info.max_requests / service
        return 1.0 / rate if rate else None

    def first_token_s(self) -> float | None:
        """The ready links' average time from submission to first token."""
        samples = [link.ledger.first_token_s for link in self.links if link.ready]
        known = [sample for sample in samples if sample is not None]
        return sum(known) / len(known) if known else None

    def predicted_wait_s(self, ticket: Ticket) -> float | None:
        return predicted_wait_s(self._queue.ahead(ticket.priority), self.free_credits(), self.per_grant_s())

    def predicted_ttft_s(self, ticket: Ticket) -> float | None:
        wait = self.predicted_wait_s(ticket)
        if wait is None:
            return None
        return wait + (self.first_token_s() or 0.0)

    def saturation(self, ticket: Ticket) -> str | None:
        """Why the route cannot take `ticket` now within its SLO or deadline; None when it can."""
        verdict = self._assess(ticket)
        return verdict.text or None

    def _assess(self, ticket: Ticket) -> _Verdict:
        free = self.free_credits()
        ahead = self._queue.ahead(ticket.priority)
        if ahead == 0 and free > 0:
            return _Verdict()  # granted at once by the dispatch that follows
        wait = predicted_wait_s(ahead, free, self.per_grant_s())
        fit = self._queue.victims(ticket)
        if isinstance(fit, tuple):
            return _Verdict(wait_s=wait, reason=fit[0], text=fit[1])
        remaining = ticket.remaining_s(time.monotonic())
        if wait is not None and remaining is not None and wait > remaining:
            text = f"predicted wait {wait:.1f} s exceeds the remaining deadline {max(0.0, remaining):.1f} s"
            return _Verdict(wait_s=wait, reason="predicted_wait", text=text)
        slo_s = self.settings.ttft_slo_ms / 1000.0
        if wait is not None and slo_s > 0:
            ttft = wait + (self.first_token_s() or 0.0)
            if ttft > slo_s:
                text = f"predicted time to first token {ttft:.1f} s exceeds the SLO {slo_s:.1f} s"
                return _Verdict(wait_s=wait, reason="ttft_slo", text=text)
        return _Verdict(victims=fit, wait_s=wait)

    def enqueue(self, ticket: Ticket) -> Admission:
        """Decide at once: a grant, a place in the queue, or Refused, Unavailable or DeadlineExceeded."""
        started = time.perf_counter()
        remaining = ticket.remaining_s(time.monotonic())
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"the deadline passed before model {self.name!r} could admit the request")
        if not self.available():
            raise Unavailable(self.unavailable_reason())
        verdict = self._assess(ticket)
        if verdict.reason:
            REJECTIONS.labels(self.name, verdict.reason).inc()
            ADMISSION_DECISION_SECONDS.labels(self.name, "refused").observe(time.perf_counter() - started)
            raise self._refusal(verdict.reason, verdict.text, verdict.wait_s)
        waiter = Waiter(ticket, asyncio.get_running_loop().create_future(), ticket.prompt_tokens)
        for victim in verdict.victims:
            self._shed(victim, verdict.wait_s)
        self._queue.push(waiter)
        if remaining is not None:
            delay = max(0.0, remaining - EXPIRY_MARGIN_S)
            waiter.timer = asyncio.get_running_loop().call_later(delay, self._expire, waiter)
        self._dispatch()
        ADMISSION_DECISION_SECONDS.labels(self.name, "admitted").observe(time.perf_counter() - started)
        return Admission(self, waiter)

    async def admit(self, ticket: Ticket) -> WorkerLink:
        """Enqueue and wait for a credit; the link's next `submit` uses the credit reserved on it."""
        admission = self.enqueue(ticket)
        try:
            await admission.granted()
        except BaseException:
            admission.close()
            raise
        return admission.hand_over()

    def set_tokens(self, waiter: Waiter, tokens: int) -> None:
        self._queue.set_tokens(waiter, tokens)

    def withdraw(self, waiter: Waiter) -> None:
        """The caller gave up: leave the queue (if still in it) and drop the deadline timer."""
        if waiter.timer is not None:
            waiter.timer.cancel()
        if self._queue.remove(waiter):
            self._dispatch()

    def _refusal(self, reason: str, text: str, wait_s: float | None) -> Refused:
        retry_s = wait_s if wait_s else self._default_retry_s
        return Refused(
            f"model {self.name!r} is overloaded: {text}; retry in {retry_s:.1f} s", retry_s, reason
        )

    def _shed(self, victim: Waiter, wait_s: float | None) -> None:
        self._queue.remove(victim)
        if victim.timer is not None:
            victim.timer.cancel()
        REJECTIONS.labels(self.name, "shed").inc()
        text = "a batch request was shed to admit an interactive one"
        if not victim.future.done():
            victim.future.set_exception(self._refusal("shed", text, wait_s))

    def _expire(self, waiter: Waiter) -> None:
        if not self._queue.remove(waiter):
            return
        REJECTIONS.labels(self.name, "deadline").inc()
        waited = time.monotonic() - waiter.enqueued
        if not waiter.future.done():
            waiter.future.set_exception(
                DeadlineExceeded(
                    f"the deadline passed after {waited:.2f} s waiting for a worker of model {self.name!r} "
                    f"({self._queue.requests} requests still waiting)"
                )
            )

    def _fail_waiting(self, error: Exception) -> None:
        for waiter in self._queue.clear():
            if waiter.timer is not None:
                waiter.timer.cancel()
            if not waiter.future.done():
                waiter.future.set_exception(error)

    def _capacity_changed(self) -> None:
        """A link's credits or readiness changed: grant what waits, or fail it if no link is left."""
        if self._queue.requests and not self.available():
            self._fail_waiting(Unavailable(self.unavailable_reason()))
            return
        self._dispatch()

    def _dispatch(self) -> None:
        while self._queue.requests:
            best = max(self.links, key=lambda link: link.credits, default=None)
            if best is None or best.credits <= 0:
                return
            waiter = self._queue.pop_next()
            if waiter is None:
                return
            if waiter.timer is not None:
                waiter.timer.cancel()
            if waiter.future.done():  # its caller was cancelled a moment ago
                continue
            best.reserve()
            waiter.future.set_result(best)
