"""One route's bounded queue of waiting slots: two priorities, and within each, tenants served fairly.

Interactive slots are served before batch ones. Within a priority, with fair queuing on, each tenant
is charged its tickets' token cost (prompt plus max_new_tokens) divided by its weight, and slots are
served in the order of their virtual finish tags (self-clocked fair queuing): a tenant's tag is where
its previous tag ended, or the lane's virtual time (the tag last served) when it was idle, plus the
new ticket's cost over its weight. A tenant that floods the queue only pushes its own tags out; a
quiet tenant's next request is tagged near the virtual time and served first. With fair queuing off,
tags are arrival order (first come, first served). A ticket's place behind others is what the
forecast reads (`ahead_slots`). The queue is bounded by `max_queued_requests` and
`max_queued_tokens` (a lone slot always fits, so one long prompt is never refused by the token budget
alone); when full, an interactive arrival evicts the batch slots served last, refused with reason
"shed". This module does no I/O and must not decide admission (route.py) nor count credits.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from typing import TYPE_CHECKING, Any

from gateway.admission import Priority

if TYPE_CHECKING:
    from gateway.admission import Ticket
    from gateway.credits import Slot
    from gateway.fair_share import FairShare

Entry = tuple[float, int, "Slot[Any]"]
"""(tag, arrival number, slot): a lane is sorted by it."""


class AdmissionQueue:
    """Waiting slots by priority and tag, with their request and token totals."""

    def __init__(self, max_requests: int, max_tokens: int, share: FairShare | None = None) -> None:
        """A `share` with fair queuing on weighs tenants; without, each priority is served first come,
        first served."""
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._share = share if share is not None and share.on else None
        self._lanes: dict[Priority, list[Entry]] = {priority: [] for priority in Priority}
        self._virtual = dict.fromkeys(Priority, 0.0)
        self._finish: dict[tuple[Priority, str], float] = {}
        self._arrivals = itertools.count()
        self.tokens = 0

    @property
    def requests(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    def queued_by_tenant(self) -> Counter[str]:
        return Counter(slot.ticket.tenant for lane in self._lanes.values() for _, _, slot in lane)

    def _tag(self, ticket: Ticket) -> float:
        """The virtual finish tag `ticket` would get now (FIFO: behind everyone)."""
        if self._share is None:
            return float("inf")
        start = max(self._virtual[ticket.priority], self._finish.get((ticket.priority, ticket.tenant), 0.0))
        return start + ticket.cost / self._share.weight(ticket.tenant)

    def ahead_slots(self, ticket: Ticket) -> list[Slot[Any]]:
        """The waiting slots `ticket` would wait behind, were it queued now, in the order served."""
        tag = self._tag(ticket)
        interactive = [s for t, _, s in self._lanes[Priority.INTERACTIVE]]
        if ticket.priority is Priority.INTERACTIVE:
            return [s for t, _, s in self._lanes[Priority.INTERACTIVE] if t < tag]
        return interactive + [s for t, _, s in self._lanes[Priority.BATCH] if t < tag]

    def ahead(self, ticket: Ticket) -> int:
        """How many waiting tickets `ticket` would wait behind."""
        return len(self.ahead_slots(ticket))

    def victims(self, ticket: Ticket) -> list[Slot[Any]] | tuple[str, str]:
        """The batch slots to shed so `ticket` fits (often none), or (reason, text) when it cannot fit."""
        count, tokens = self.requests, self.tokens
        shed: list[Slot[Any]] = []
        batch = self._lanes[Priority.BATCH]
        sheddable = (
            (s for _, _, s in reversed(batch)) if ticket.priority is Priority.INTERACTIVE else iter(())
        )
        while count + 1 > self.max_requests or (count and tokens + ticket.prompt_tokens > self.max_tokens):
            victim = next(sheddable, None)
            if victim is None:
                if count + 1 > self.max_requests:
                    text = f"queue full: {count} requests waiting (max_queued_requests={self.max_requests})"
                    return "queue_full", text
                text = (
                    f"token budget: {tokens} prompt tokens waiting + {ticket.prompt_tokens} would exceed "
                    f"max_queued_tokens={self.max_tokens}"
                )
                return "token_budget", text
            shed.append(victim)
            count -= 1
            tokens -= victim.tokens
        return shed

    def push(self, slot: Slot[Any]) -> None:
        ticket = slot.ticket
        arrival = next(self._arrivals)
        tag = self._tag(ticket)
        if self._share is None:
            tag = float(arrival)
        else:
            self._finish[(ticket.priority, ticket.tenant)] = tag
        bisect.insort(self._lanes[ticket.priority], (tag, arrival, slot), key=lambda entry: entry[:2])
        self.tokens += slot.tokens

    def remove(self, slot: Slot[Any]) -> bool:
        """Take a slot out (cancelled, expired, shed); False when it was not waiting."""
        lane = self._lanes[slot.ticket.priority]
        for index, (_, _, waiting) in enumerate(lane):
            if waiting is slot:
                del lane[index]
                self.tokens -= slot.tokens
                return True
        return False

    def peek_next(self) -> Slot[Any] | None:
        """The slot `pop_next` would take, left in the queue."""
        lane = next((lane for lane in self._lanes.values() if lane), None)
        return lane[0][2] if lane is not None else None

    def waiting(self) -> list[Slot[Any]]:
        """The waiting slots in the order served, left in the queue."""
        return [slot for lane in self._lanes.values() for _, _, slot in lane]

    def pop_next(self) -> Slot[Any] | None:
        """The next slot to serve: the lowest tag of the interactive lane, else of the batch lane."""
        for priority in Priority:
            lane = self._lanes[priority]
            if lane:
                tag, _, slot = lane.pop(0)
                if self._share is not None:
                    self._virtual[priority] = tag
                self.tokens -= slot.tokens
                return slot
        return None

    def set_tokens(self, slot: Slot[Any], tokens: int) -> None:
        """The exact prompt size, once tokenized, replaces the estimate in the totals."""
        if any(waiting is slot for _, _, waiting in self._lanes[slot.ticket.priority]):
            self.tokens += tokens - slot.tokens
        slot.tokens = tokens
        slot.exact = True

    def clear(self) -> list[Slot[Any]]:
        """Empty the queue, returning every slot in the order it would have been served."""
        slots = self.waiting()
        for lane in self._lanes.values():
            lane.clear()
        self.tokens = 0
        return slots
