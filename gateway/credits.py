"""Worker credits in the gateway: one stream's count of them, and the Slot through which a request holds one.

A worker accepts at most `limit` requests (its hello's max_requests), shared by every gateway connected
to it, and reports its free credits in every message. A report may predate submissions still on the
wire, so the gateway does not subtract from the report: it learns from each report only how many
credits *other* gateways hold (limit - reported - the requests this stream has open there, never below
zero, since the worker cannot have counted more of ours than we sent). The credits this gateway may
still use are limit - others - held, where held counts the Slots granted on the stream and not yet
released. With one gateway this is exact at every moment; with several, another gateway's submissions
in flight can still make a submission arrive to a full worker, which the worker then refuses.

A Slot is one request's claim on a credit for one submission, from its place in a route's queue to its
end: the route's dispatcher grants it on a link (taking the credit), and `release` is the only way the
credit returns. `release` is idempotent and covers every state; the route it came from releases it
(`Route.release`: a waiting slot leaves the queue, one whose submission is still open on the worker
has it cancelled there, and the freed credit is granted). The attempt, which holds the slot for the
request's lifecycle, has it released on every path. This module does no I/O, calls nothing above it,
and must not choose links (route.py does) nor queue requests.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterator

    from gateway.admission import Ticket
    from gateway.forecast import Forecast


class CreditLink(Protocol):
    """What a Slot needs of the link its credit is on (a WorkerLink): the stream's credits."""

    @property
    def credits(self) -> StreamCredits: ...


LinkT = TypeVar("LinkT", bound=CreditLink)


class StreamCredits:
    """One worker stream's credit limit, other gateways' share, and the slots held on it; its counts
    change only through its methods."""

    def __init__(self) -> None:
        self.limit = 0
        self.others = 0
        """Credits other gateways held at the worker's last report."""
        self.held = 0
        """Slots granted on this stream and not released: its requests about to be sent, or sent."""
        self.unsent: set[Slot[Any]] = set()
        """The held slots whose submissions are not sent yet (their prompts are being tokenized): the
        forecast counts them by their own sizes."""

    def available(self) -> int:
        """Credits free for new grants."""
        return max(0, self.limit - self.others - self.held)

    def reset(self, limit: int, reported: int) -> None:
        """A new stream: the worker's limit and its credits before this stream sent anything."""
        self.limit = limit
        self.others = max(0, limit - reported)

    def report(self, reported: int, open_on_worker: int) -> None:
        """The worker's credits in a message, with this stream's requests still open on the worker."""
        self.others = max(0, self.limit - reported - open_on_worker)

    def take(self, slot: Slot[Any]) -> None:
        """A grant: `slot` holds one credit here, its submission not sent yet."""
        self.held += 1
        self.unsent.add(slot)

    def sent(self, slot: Slot[Any]) -> None:
        """`slot`'s submission is on the wire; it keeps its credit until released."""
        self.unsent.discard(slot)

    def give_back(self, slot: Slot[Any]) -> None:
        """`slot` released its credit here (or moved it to another stream)."""
        self.held -= 1
        self.unsent.discard(slot)

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Count one held credit as free meanwhile: a choice that may keep a slot here or move it."""
        self.held -= 1
        try:
            yield
        finally:
            self.held += 1


class Slot(Generic[LinkT]):
    """One request's claim on a worker credit for one submission, on a link of type LinkT. Used from
    the event loop only."""

    def __init__(self, ticket: Ticket) -> None:
        self.ticket = ticket
        self.tokens = ticket.prompt_tokens
        """The prompt size the queue counts: the estimate, then the exact count."""
        self.exact = False
        """`tokens` is the exact count: the prompt was tokenized."""
        self.enqueued = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None
        """Fires at the ticket's deadline while the slot waits."""
        self.forecast: Forecast | None = None
        """What admission forecast for it (forecast.py); None without a forecast."""
        self.link: LinkT | None = None
        """The link the credit was granted on; None while waiting."""
        self.wire_id = ""
        """The submission's id on the link's stream, once submitted."""
        self.prefix_key: int | None = None
        """The prompt's routing key (prefix_routing.py) once tokenized; None before or when off."""
        self.route_reason = ""
        """Why the credit is on its link (prefix_routing.py's reasons); empty while waiting."""
        self.preferred = ""
        """The replica the prompt's prefix preferred; empty without a key."""
        self._outcome: asyncio.Future[LinkT] = asyncio.get_running_loop().create_future()
        self._released = False

    @property
    def first_token_due(self) -> float | None:
        """When admission forecast its first token (time.monotonic(), the link's margin left out);
        None when there was no forecast or only a cold one (Forecast.priced)."""
        forecast = self.forecast
        if forecast is None or not forecast.priced:
            return None
        return self.enqueued + forecast.ttft_s - forecast.margin_s

    @property
    def decided(self) -> bool:
        """Granted, refused, or given up: no longer waiting for the dispatcher."""
        return self._outcome.done()

    def grant(self, link: LinkT) -> None:
        """The dispatcher's grant: take one of `link`'s credits for this slot."""
        link.credits.take(self)
        self.link = link
        self._outcome.set_result(link)

    def refuse(self, error: Exception) -> None:
        """The slot left the queue without a credit (shed, expired, no worker left)."""
        if not self._outcome.done():
            self._outcome.set_exception(error)

    def move(self, link: LinkT) -> None:
        """Carry a granted, unsent credit to `link` (prefix routing's choice once the prompt is
        tokenized): the old link gets its credit back at once."""
        old = self.link
        if old is None or self.wire_id or self._released:
            raise RuntimeError("only a granted slot whose submission is not sent yet can move")
        link.credits.take(self)
        self.link = link
        old.credits.give_back(self)

    async def granted(self) -> LinkT:
        """Wait for the grant; the link it is on.

        Raises what `refuse` was given: Refused ("shed"), DeadlineExceeded or Unavailable.
        """
        await self._outcome
        assert self.link is not None  # set by grant, changed only by move
        return self.link

    def release(self) -> bool:
        """Give the claim up, whatever its state: a granted credit goes back to its link's count. True
        the first time (the route then takes a waiting slot out of its queue, or cancels a sent
        submission and grants the freed credit); False after."""
        if self._released:
            return False
        self._released = True
        if self.timer is not None:
            self.timer.cancel()
        if not self._outcome.done():
            self._outcome.cancel()
        if self.link is not None:
            self.link.credits.give_back(self)
        return True
