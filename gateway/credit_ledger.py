"""The gateway's count of one worker's credits, and how long its requests take (first token, last).

The worker holds at most `limit` requests (its hello's max_requests), shared by every gateway
connected to it, and reports its free credits in every message. A report may predate submissions
still on the wire, so the gateway does not subtract from the report: it counts its own open requests
on the stream itself, and learns from each report only how many credits *other* gateways hold
(limit - reported - our open requests, never below zero, since the worker cannot have counted more of
ours than we sent). The credits it may use are limit - our open requests - others' - reserved (the
credits admission granted to requests about to be submitted). With one gateway this is exact at every
moment; with several, another gateway's submissions in flight can still make a submission arrive to a
full worker, which the worker then refuses. Cancellations free credits in stream order: the worker
reads a cancellation before any submission queued after it. This module does no I/O: worker_link.py
feeds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata.v1 import common_pb2

if TYPE_CHECKING:
    from strata.v1 import worker_pb2

EWMA_WEIGHT = 0.2
COMPLETED = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


def ewma(previous: float | None, sample: float) -> float:
    return sample if previous is None else previous + EWMA_WEIGHT * (sample - previous)


class CreditLedger:
    """One worker stream's credit limit, other gateways' share, reservations and request timings."""

    def __init__(self) -> None:
        self.limit = 0
        self.others = 0
        """Credits other gateways held at the worker's last report."""
        self.reserved = 0
        self._sent_at: dict[str, float] = {}
        self._waiting_first: set[str] = set()
        self.first_token_s: float | None = None
        """Moving average of the seconds from submission to a request's first update."""
        self.service_s: float | None = None
        """Moving average of the seconds from submission to a completed request's last update."""

    def available(self, open_requests: int) -> int:
        """Credits free for new submissions while this stream holds `open_requests`."""
        return max(0, self.limit - open_requests - self.others - self.reserved)

    def reset(self, limit: int, reported: int) -> None:
        """A new stream: the worker's limit and its credits before this stream sent anything."""
        self.limit = limit
        self.others = max(0, limit - reported)
        self._sent_at.clear()
        self._waiting_first.clear()

    def report(self, reported: int, open_requests: int) -> None:
        """The worker's credits in a message, with this stream's open requests after applying it."""
        self.others = max(0, self.limit - reported - open_requests)

    def reserve(self) -> None:
        self.reserved += 1

    def release(self) -> None:
        self.reserved = max(0, self.reserved - 1)

    def sent(self, wire_id: str, now: float) -> None:
        """A submission was queued for the worker."""
        self._sent_at[wire_id] = now
        self._waiting_first.add(wire_id)

    def forget(self, wire_id: str) -> None:
        """The request ended without a completed generation (cancelled, rejected): it is not timed."""
        self._sent_at.pop(wire_id, None)
        self._waiting_first.discard(wire_id)

    def time(self, response: worker_pb2.ConnectResponse, now: float) -> None:
        """Time the first and last updates in a worker message."""
        for rejection in response.rejections:
            self.forget(rejection.request_id)
        for update in response.updates:
            request_id = update.request_id
            sent = self._sent_at.get(request_id)
            if sent is None:
                continue
            if request_id in self._waiting_first:
                self._waiting_first.discard(request_id)
                self.first_token_s = ewma(self.first_token_s, now - sent)
            if update.finished:
                del self._sent_at[request_id]
                if update.finish_reason in COMPLETED:  # an aborted request says nothing of the rate
                    self.service_s = ewma(self.service_s, now - sent)
