"""One route's admission judgement: the forecast for a ticket on given links, and whether to refuse it.

The judge prices a ticket as the forecast (forecast.py) sees it: its exact prompt size once tokenized,
else the size its byte bound likely has (`PromptEstimate`, learnt from the route's tokenized prompts),
less what a worker's prefix cache likely holds of it (each link's CachedPrefixes, prompt_prefix.py),
behind the slots ahead of it in the route's queue and the granted but unsent slots of each link. It
then says whether the route must refuse the ticket now: the queue is full and nothing can be shed, no
worker has reported a step yet and the ticket cannot start at once, the deadline is shorter than the
forecast wait, or the forecast time to first token exceeds `ttft_slo_share` of the SLO. This module
must not change the queue, grant credits or choose a replica (route.py and prefix_routing.py do).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gateway.admission import PromptEstimate
from gateway.forecast import Forecast, LinkView, forecast

if TYPE_CHECKING:
    from gateway.admission import Ticket
    from gateway.admission_queue import AdmissionQueue
    from gateway.credits import Slot
    from gateway.fair_share import FairShare
    from gateway.settings import RouteSettings
    from gateway.worker_link import WorkerLink

Refusal = tuple[str, str, "float | None"]
"""(reason, text, retry hint in seconds or None)."""


class AdmissionJudge:
    """Forecasts and refusals for one route's tickets."""

    def __init__(self, settings: RouteSettings, queue: AdmissionQueue, share: FairShare) -> None:
        """`share` says what a tenant's request may take on a link and the priority it has there."""
        self._settings = settings
        self._queue = queue
        self._share = share
        self.prompts = PromptEstimate()
        """What the route's prompts tokenize to against their byte bounds; the route feeds it."""

    def forecast(self, ticket: Ticket, links: list[WorkerLink]) -> Forecast | None:
        """When `ticket` would start and get its first token on one of `links`, queued now; None before
        any of them reported a step."""
        views = [self._view(ticket, link) for link in links]
        ahead = [self._exact(slot, links) for slot in self._queue.ahead_slots(ticket)]
        return forecast(views, ahead, self._sized(ticket, None))

    def _view(self, ticket: Ticket, link: WorkerLink) -> LinkView:
        favoured = self._share.favoured(ticket.tenant, link.load)
        return LinkView(
            link.load,
            link.load.slots(link.credits.limit),
            self._share.usable_credits(ticket.tenant, link, favoured),
            [self._exact(slot, [link]) for slot in link.credits.unsent],
            ticket.priority.worker_priority(favoured),
            self._cached(ticket, [link]),
        )

    def _exact(self, slot: Slot[Any], links: list[WorkerLink]) -> Ticket:
        """A queued or granted ticket as the forecast prices it: sized, less what the worker it will
        likely run on (the one of `links` that has most of it) has cached."""
        sized = self._sized(slot.ticket, slot.tokens if slot.exact else None)
        cached = min(self._cached(sized, links), sized.prompt_tokens - 1)
        return replace(sized, prompt_tokens=sized.prompt_tokens - max(0, cached))

    def _sized(self, ticket: Ticket, exact: int | None) -> Ticket:
        """`ticket` as the forecast prices it: its exact prompt size when tokenized, else the size its
        bound likely has (PromptEstimate)."""
        tokens = exact if exact is not None else self.prompts.expected(ticket.prompt_tokens)
        return replace(ticket, prompt_tokens=tokens)

    def _cached(self, ticket: Ticket, links: list[WorkerLink]) -> int:
        """The most of `ticket`'s prompt one of `links`' prefix caches likely serves."""
        return max((link.load.cache.cached_tokens(ticket.prefix) for link in links), default=0)

    def refusal(
        self, ticket: Ticket, predicted: Forecast | None, free_credits: int, links: list[WorkerLink]
    ) -> Refusal | None:
        """Why `ticket` must be refused now, given its forecast and the route's free credits and links;
        None when it is admitted."""
        wait = predicted.start_s if predicted is not None and predicted.start_s > 0 else None
        at_once = self._queue.ahead(ticket) == 0 and free_credits > 0
        if not at_once:
            fit = self._queue.victims(ticket)
            if isinstance(fit, tuple):
                return fit[0], fit[1], wait
        slo_s = self._settings.ttft_slo_ms / 1000.0
        if predicted is None:
            if at_once or slo_s <= 0:
                return None  # it starts now, and its steps will make the first forecast
            text = (
                "no worker has reported a step yet to forecast a wait from: only requests that start at once"
            )
            return "ttft_slo", text, None
        ttft = predicted.ttft_s
        remaining = ticket.remaining_s(time.monotonic())
        if remaining is not None and ttft > remaining:
            text = (
                f"the remaining deadline {max(0.0, remaining):.2f} s is shorter than the forecast wait "
                f"for a first token, {ttft:.2f} s"
            )
            return "predicted_wait", text, wait
        # An idle worker's step time may be old: a request it can take at once is admitted, and its
        # steps bring the forecast up to date.
        idle = all(link.load.open_requests == 0 for link in links)
        limit_s = slo_s * self._settings.ttft_slo_share
        if slo_s > 0 and not (at_once and idle) and ttft > limit_s:
            text = (
                f"forecast time to first token {ttft:.2f} s exceeds {limit_s:.2f} s "
                f"({self._settings.ttft_slo_share:g} of the SLO {slo_s:.1f} s)"
            )
            return "ttft_slo", text, wait
        return None
