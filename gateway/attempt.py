"""One try of a request on one route: its Slot from the queue to the end, and once sent, its submission.

An Attempt is made by queueing the request on a route (`Attempt.place`: refusals are raised at once,
before anything is awaited) and is used as a context manager around the rest of its life. Whatever
ends it (the last update, a worker failure, a queue that let it go, the client cancelling, an error),
leaving the block releases its slot, which gives the worker credit back and cancels the submission on
the worker if it is still open there, and closes its spans. While sent, it keeps what the StageClock
needs of it (when it was sent, when its last update arrived, the worker's own time, the last update's
Detokenize call, from the deltas the pipeline hands it with `record`), and the request's clock and
trace are moved at its start and its end only. The attempt never changes the request's answer nor
its facts (the pipeline does). This module must not do I/O nor decide where a request goes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gateway.errors import Unavailable
from gateway.request_ids import wire_id
from gateway.request_trace import CONNECT_RPC
from strata.v1 import common_pb2, worker_pb2

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from gateway.credits import Slot
    from gateway.fallback import Detour
    from gateway.request import Request
    from gateway.request_values import Delta
    from gateway.route import Route
    from gateway.stage_clock import Call
    from gateway.worker_link import WorkerLink


class Attempt:
    """One slot of the request on one route. Used from the event loop only."""

    def __init__(
        self,
        request: Request,
        route: Route,
        detour: Detour | None,
        slot: Slot[WorkerLink],
        replica_retries: int,
    ) -> None:
        self.request = request
        self.route = route
        self.detour = detour
        """Why the request is on this route rather than its primary; None on the primary."""
        self.slot = slot
        self.replica_retries = replica_retries
        """Attempts before this one on other replicas of the same route, after losing a worker."""
        self.prompt_ids: list[int] = []
        """What the attempt sent as the prompt (prior output ids aside)."""
        self.hop: Span | None = None
        """The Connect span, once sent (None when untraced)."""
        self.submitted: float | None = None
        """time.perf_counter() when the submission was queued for the worker; None until sent."""
        self.received: float | None = None
        """When the message with the attempt's last update arrived; None when none arrived."""
        self.worker_queue_ms = 0.0
        """The worker's queue time (its first update's queue_ms)."""
        self.worker_ms = 0.0
        """The worker's time from receipt to its last update: queue_ms plus that update's forward_ms."""
        self.detokenize: Call | None = None
        """The last update's Detokenize call."""
        self.ended: float | None = None
        """When the attempt's last delta (final or failure) was taken up; None while it runs."""

    @classmethod
    def place(cls, request: Request, route: Route, detour: Detour | None, replica_retries: int) -> Attempt:
        """Queue the request on `route`; raises Refused, Unavailable or DeadlineExceeded at once."""
        slot = route.enqueue(request.ticket(), request.prompt_ids)
        request.trace.admitted(slot.forecast.ttft_s if slot.forecast is not None else None, request.arrival)
        return cls(request, route, detour, slot, replica_retries)

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.route.release(self.slot)
        if self.submitted is not None and self.ended is None:  # cancelled or failed while it ran
            self.request.trace.close_hop(self.hop, time.perf_counter())

    async def granted(self) -> WorkerLink:
        """Wait for a worker credit; the link it is on. Raises why the queue let the request go."""
        request, route, slot = self.request, self.route, self.slot
        # The exact prompt size replaces the estimate; the tokenized prompt lets the route choose by prefix.
        route.set_tokens(slot, len(request.prompt_ids) + len(request.token_ids))
        if request.prompt_ids:
            route.set_prompt(slot, request.prompt_ids)
        link = await slot.granted()
        self.request.trace.routed(link.address, self.slot.route_reason, self.slot.preferred)
        return link

    def send(self, link: WorkerLink) -> None:
        """Submit on the granted link: the wait so far was queueing; the worker's part begins."""
        request = self.request
        prior = list(request.token_ids)
        self.prompt_ids = list(request.prompt_ids)
        trace = request.trace
        self.hop = trace.open_hop(CONNECT_RPC, time.perf_counter(), **{"server.address": link.address})
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.valid.sampling)
        sampling.ClearField("stop")  # stop strings are matched here, not by the worker
        submission = worker_pb2.Submission(
            request_id=wire_id(request.valid.request_id),
            prompt_ids=self.prompt_ids,
            sampling=sampling,
            deadline_unix_ms=request.incoming.deadline_unix_ms,
            trace_context=trace.carrier(self.hop) or request.incoming.trace_context,
            priority=self.route.worker_priority(request.priority, self.slot.ticket.tenant, link),
            prior_output_ids=prior,
            # The tenant salts the worker's prefix cache: tenants never share cached blocks (the
            # worker adds the adapter's own salt).
            cache_salt=self.slot.ticket.tenant,
            itl_slo_ms=self.route.settings.itl_slo_ms,
            adapter=request.adapter_on(self.route),
        )
        self.submitted = time.perf_counter()
        request.clock.wait("queue", self.submitted)
        trace.emit(request.clock)
        try:
            link.submit(self.slot, submission, request.sink)
        except Unavailable as error:  # the link broke between the grant and now: this attempt failed
            request.sink.fail(error)

    def record(self, deltas: list[Delta]) -> None:
        """Keep this attempt's part of the deltas it sent, before the request makes its chunk of them;
        an error or a finish among them ends the attempt (nothing of it follows)."""
        for delta in deltas:
            if delta.error is not None:
                self.end()
                return
            if delta.from_worker:
                self._took(delta)
            if delta.finished:
                self.end()
                return

    def _took(self, delta: Delta) -> None:
        """Keep what the attempt's part needs: the last update's arrival, worker time and decode call."""
        if self.received is None:
            self.worker_queue_ms = delta.queue_ms
        self.received = delta.received
        self.worker_ms = self.worker_queue_ms + delta.forward_ms
        self.detokenize = delta.detokenize

    def end(self) -> None:
        """The attempt's last delta was taken up: its credit goes back, its time to the clock's stages."""
        if self.ended is not None or self.submitted is None:
            return
        self.ended = time.perf_counter()
        self.route.release(self.slot)
        request = self.request
        request.clock.worker_attempt(
            submitted=self.submitted,
            ended=self.ended,
            received=self.received,
            worker_queue_ms=self.worker_queue_ms,
            worker_ms=self.worker_ms,
            detokenize=self.detokenize,
        )
        request.trace.emit(request.clock, {"worker": self.hop})
        request.trace.close_hop(self.hop, self.received if self.received is not None else self.ended)
