"""A route: one model's worker links, its admission queue, and the dispatcher that grants their credits.

A request passes one door per route. `Route.enqueue` decides at once, without awaiting anything:
UNAVAILABLE when no link is ready, DEADLINE_EXCEEDED when the deadline already passed, a Refused
(RESOURCE_EXHAUSTED with the reason and the forecast wait as retry hint) when admission_judge.py says
the queue is full or the forecast time to first token exceeds the deadline or `ttft_slo_share` of the
SLO, else a Slot in the bounded queue. Admission is a promise: an admitted request must meet the SLO, so
the forecast counts every request as running to its max_new_tokens and the share keeps a margin. The
caller tokenizes while it waits, then awaits `Slot.granted`. The dispatcher runs whenever a link's
credits or readiness change (each worker message carries credits) and when a slot arrives: it grants the
waiting slots in priority order, each grant taking one credit (credits.py), so a worker is never sent
more than it accepts, on the link prefix_routing.py chooses: the replica the prompt's prefix hashes to
while it is within the load bound, else the ready link with the most credit. A slot is usually granted
before its prompt is tokenized (a credit was free at once); once tokenized, `set_prompt` moves its
unsent credit to the prefix's replica when that is another with a credit free. With fair queuing on, a
tenant below its weighted share of a link is sent favoured there and may take the credits kept for such
tenants (fair_share.py); the dispatcher serves the queue in order, except that a head which may not take
them lets the first waiting slot of such a tenant take one. Slots granted in one pass are submitted in
one event-loop tick and so share one ConnectRequest. A slot whose deadline passes while it waits leaves
the queue with DEADLINE_EXCEEDED (nothing was sent to a worker). The route releases the slots it made
(`release`): a waiting one leaves the queue, a granted one's credit is granted again and its submission
cancelled on the worker if still open. This module must not talk to workers itself (worker_link.py
does, on its commands), find them (discovery.py) nor validate requests.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gateway.admission import Priority, Refused, Ticket
from gateway.admission_judge import AdmissionJudge
from gateway.admission_queue import AdmissionQueue
from gateway.credits import Slot
from gateway.discovery import Discovery, resolve
from gateway.errors import DeadlineExceeded, Unavailable
from gateway.fair_share import FairShare
from gateway.metrics import ADMISSION_DECISION_SECONDS, REJECTIONS
from gateway.prefix_routing import Ring, choose, prefix_key
from gateway.prompt_prefix import NO_PREFIX

if TYPE_CHECKING:
    from collections import Counter
    from collections.abc import Callable

    from gateway.discovery import Resolver
    from gateway.forecast import Forecast
    from gateway.prefix_routing import Choice
    from gateway.settings import GatewaySettings, RouteSettings
    from gateway.worker_link import WorkerLink
    from strata.v1 import common_pb2

    MakeLink = Callable[[str, str, Callable[[], None]], WorkerLink]
    """(address, model, on_capacity) -> a new link that calls `on_capacity` when its credits or
    readiness change."""

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
    kv_cache_tokens: int
    """Tokens the KV caches of the ready workers hold together."""
    memory: common_pb2.MemoryBudget | None
    """The memory budget of the first worker that reported one."""
    native_kernels: tuple[str, ...]
    """The native kernels' distinct states on the ready workers."""
    model_family: str
    """The family the first ready worker reports; empty before one is ready."""
    native_paths: tuple[str, ...]
    """The native CPU paths' distinct descriptions on the ready workers."""
    weights_format: tuple[str, ...]
    """How the ready workers hold their weights, each distinct answer once."""


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
        weights = {tenant.name: tenant.weight for tenant in gateway.tenants}
        self._share = FairShare(weights, settings.fair_reserve_share, gateway.fair_queuing)
        self._queue = AdmissionQueue(settings.max_queued_requests, settings.max_queued_tokens, self._share)
        self._judge = AdmissionJudge(settings, self._queue, self._share)
        self._ring = Ring(())
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

    def queued_by_tenant(self) -> Counter[str]:
        return self._queue.queued_by_tenant()

    def start(self) -> None:
        self._discovery.start()

    async def close(self) -> None:
        await self._discovery.close()
        self._fail_waiting(Unavailable(f"the gateway stopped serving model {self.name!r}"))

    def available(self) -> bool:
        """Some link is connected, serving and taking requests."""
        return any(link.ready and not link.leaving for link in self.links)

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
        ready = [link.info for link in links if link.ready and link.info is not None]
        return RouteStatus(
            model=self.name,
            max_model_len=self.max_model_len() or 0,
            ready_workers=sum(1 for link in links if link.ready),
            configured_workers=len(links),
            queued_requests=self.queued_requests,
            kv_cache_tokens=sum(info.memory.kv_tokens for info in ready),
            memory=next(
                (
                    link.info.memory
                    for link in links
                    if link.info is not None and link.info.HasField("memory")
                ),
                None,
            ),
            native_kernels=tuple(dict.fromkeys(info.native_kernels for info in ready if info.native_kernels)),
            model_family=next((info.model_family for info in ready if info.model_family), ""),
            native_paths=tuple(dict.fromkeys(info.native_paths for info in ready if info.native_paths)),
            weights_format=tuple(dict.fromkeys(info.weights_format for info in ready if info.weights_format)),
        )

    def free_credits(self, tenant: str) -> int:
        """The credits a request of `tenant` may take on the route's links now."""
        return sum(self._share.usable_credits(tenant, link) for link in self.links)

    def worker_priority(self, priority: Priority, tenant: str, link: WorkerLink) -> int:
        """Submission.priority for a request of `tenant` on `link` (fair_share.py): the worker prefills
        favoured prompts first and preempts a less favoured sequence for one when its running slots are
        full, so a flood sent while the worker had credits cannot hold a quiet tenant behind it."""
        return self._share.worker_priority(priority, tenant, link.load)

    def forecast(self, ticket: Ticket) -> Forecast | None:
        """When `ticket` would start and get its first token, queued now; None before any step report."""
        return self._judge.forecast(ticket, self._ready_links())

    def _forecast_for(self, ticket: Ticket, key: int | None) -> Forecast | None:
        """The forecast on the replica `key` would be sent to now; the route's without a key."""
        if key is not None:
            choice = self._choose_key(key, ticket.tenant)
            if choice is not None:
                return self._judge.forecast(ticket, [choice.replica])
        return self.forecast(ticket)

    def saturation(self, ticket: Ticket) -> str | None:
        """Why the route cannot take `ticket` now within its SLO or deadline; None when it can."""
        ticket = self._priced(ticket)
        credits = self.free_credits(ticket.tenant)
        found = self._judge.refusal(ticket, self.forecast(ticket), credits, self.links)
        return found[1] if found is not None else None

    def enqueue(self, ticket: Ticket, prompt_ids: list[int] | None = None) -> Slot[WorkerLink]:
        """Decide at once: a Slot in the queue (granted at once when a credit is free), or raise Refused,
        Unavailable or DeadlineExceeded. With `prompt_ids` (a retry or a failover: already tokenized)
        the slot is routed by its prefix and the forecast is the chosen replica's."""
        started = time.perf_counter()
        ticket = self._priced(ticket)
        remaining = ticket.remaining_s(time.monotonic())
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"the deadline passed before model {self.name!r} could admit the request")
        if not self.available():
            raise Unavailable(self.unavailable_reason())
        key = prefix_key(ticket.tenant, prompt_ids or [], self.settings.prefix_routing_tokens)
        predicted = self._forecast_for(ticket, key)
        saturated = self._judge.refusal(ticket, predicted, self.free_credits(ticket.tenant), self.links)
        if saturated is not None:
            reason, text, wait = saturated
            REJECTIONS.labels(self.name, reason).inc()
            ADMISSION_DECISION_SECONDS.labels(self.name, "refused").observe(time.perf_counter() - started)
            raise self._refusal(reason, text, wait)
        victims = self._queue.victims(ticket)
        wait = predicted.start_s if predicted is not None else None
        slot: Slot[WorkerLink] = Slot(ticket)
        slot.forecast = predicted
        slot.prefix_key = key
        for victim in victims if isinstance(victims, list) else ():
            self._shed(victim, wait)
        self._queue.push(slot)
        if remaining is not None:
            delay = max(0.0, remaining - EXPIRY_MARGIN_S)
            slot.timer = asyncio.get_running_loop().call_later(delay, self._expire, slot)
        self._dispatch()
        ADMISSION_DECISION_SECONDS.labels(self.name, "admitted").observe(time.perf_counter() - started)
        return slot

    def _priced(self, ticket: Ticket) -> Ticket:
        """`ticket` as this route forecasts it: without its prompt's piece hashes when the route's
        forecast_cached_prompts is off, so no cached part of it is guessed, here or on its link."""
        return ticket if self.settings.forecast_cached_prompts else replace(ticket, prefix=NO_PREFIX)

    def set_tokens(self, slot: Slot[WorkerLink], tokens: int) -> None:
        self._judge.prompts.observe(slot.ticket.prompt_tokens, tokens)
        self._queue.set_tokens(slot, tokens)

    def set_prompt(self, slot: Slot[WorkerLink], prompt_ids: list[int]) -> None:
        """The slot's prompt is tokenized: a waiting slot is granted by its prefix; one the dispatcher
        granted before the prompt was known (a credit was free at once) moves to the replica its
        prefix chooses when that is another and has a free credit, since nothing was sent yet; the
        forecast is then the chosen replica's."""
        slot.prefix_key = prefix_key(slot.ticket.tenant, prompt_ids, self.settings.prefix_routing_tokens)
        link = slot.link
        if slot.prefix_key is None or link is None or slot.wire_id:
            return
        # The slot's own credit is free for this choice: it is about to leave `link` or stay.
        with link.credits.set_aside():
            choice = self._choose(slot)
        if choice is None:
            return
        chosen = choice.replica
        slot.route_reason, slot.preferred = choice.reason, choice.preferred
        if chosen is not link:
            slot.move(chosen)
            slot.forecast = self._judge.forecast(slot.ticket, [chosen]) or slot.forecast
            self._capacity_changed()  # the credit it left on `link` may go to a waiting slot

    def release(self, slot: Slot[WorkerLink]) -> None:
        """Give up `slot`, whatever its state; idempotent. A slot never granted leaves the queue; a
        granted one gives its credit back, its submission is cancelled on the worker if still open
        there, and the credit goes to a waiting slot."""
        if not slot.release():
            return
        link = slot.link
        if link is None:
            if self._queue.remove(slot):
                self._dispatch()
            return
        link.cancel(slot.wire_id)
        self._capacity_changed()

    def _refusal(self, reason: str, text: str, wait_s: float | None) -> Refused:
        retry_s = wait_s if wait_s else self._default_retry_s
        return Refused(
            f"model {self.name!r} is overloaded: {text}; retry in {retry_s:.1f} s", retry_s, reason
        )

    def _leave(self, slot: Slot[WorkerLink], error: Exception) -> None:
        """A waiting slot leaves the queue without a credit."""
        if slot.timer is not None:
            slot.timer.cancel()
        slot.refuse(error)

    def _shed(self, victim: Slot[WorkerLink], wait_s: float | None) -> None:
        self._queue.remove(victim)
        REJECTIONS.labels(self.name, "shed").inc()
        text = "a batch request was shed to admit an interactive one"
        self._leave(victim, self._refusal("shed", text, wait_s))

    def _expire(self, slot: Slot[WorkerLink]) -> None:
        if not self._queue.remove(slot):
            return
        REJECTIONS.labels(self.name, "deadline").inc()
        waited = time.monotonic() - slot.enqueued
        self._leave(
            slot,
            DeadlineExceeded(
                f"the deadline passed after {waited:.2f} s waiting for a worker of model {self.name!r} "
                f"({self._queue.requests} requests still waiting)"
            ),
        )

    def _fail_waiting(self, error: Exception) -> None:
        for slot in self._queue.clear():
            self._leave(slot, error)

    def _capacity_changed(self) -> None:
        """A link's credits or readiness changed: grant what waits, or fail it if no link is left."""
        if self._queue.requests and not self.available():
            self._fail_waiting(Unavailable(self.unavailable_reason()))
            return
        self._dispatch()

    def _choose(self, slot: Slot[WorkerLink]) -> Choice[WorkerLink] | None:
        """The ready link for `slot` (by its prefix when known); None when no link has a credit its
        tenant may take."""
        return self._choose_key(slot.prefix_key, slot.ticket.tenant)

    def _ready_links(self) -> list[WorkerLink]:
        return [link for link in self.links if link.ready and not link.leaving]

    def _choose_key(self, key: int | None, tenant: str) -> Choice[WorkerLink] | None:
        links = self._ready_links()
        addresses = tuple(sorted(link.address for link in links))
        if addresses != self._ring.addresses:
            self._ring = Ring(addresses)
        factor = self.settings.prefix_routing_load_factor
        credits = {link.address: self._share.usable_credits(tenant, link) for link in links}
        return choose(links, self._ring, key, factor, credits)

    def _dispatch(self) -> None:
        while (slot := self._queue.peek_next()) is not None:
            choice = None if slot.decided else self._choose(slot)
            if choice is None and not slot.decided:
                # The head may not take the credits kept for tenants below their share: the first
                # waiting slot of such a tenant may; everyone else keeps the queue's order.
                reserved = next(
                    ((s, c) for s in self._queue.waiting() if not s.decided and (c := self._choose(s))),
                    None,
                )
                if reserved is None:
                    return
                slot, choice = reserved
                self._queue.remove(slot)
            else:
                self._queue.pop_next()
            if slot.timer is not None:
                slot.timer.cancel()
            if choice is None:  # its request was released a moment ago
                continue
            slot.route_reason, slot.preferred = choice.reason, choice.preferred
            slot.grant(choice.replica)
