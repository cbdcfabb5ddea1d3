"""Splits one request's wall time in the gateway into the stages it waited on, without overlap.

A StageClock holds a cursor: every moment from the request's arrival up to the cursor has been given
to exactly one stage, so the parts always sum to the time elapsed. The pipeline moves the cursor as
the request goes: waiting for a turn (`wait`), a call to another service (`hop`: the server's own time
goes to the stage it served, the rest of the client-side time to network), and one attempt on a worker
(`worker_attempt`). Within an attempt, the worker's own reported time (its queue, then its forward
steps) is what the request waited on up to the last update; the rest of that interval is network
(both directions, framing, the worker's outbound queue); the last update's detokenize call and the
gateway's own work on it are decode, minus that call's network. Earlier updates' detokenize calls ran
while the worker computed the next steps, so they are not on the request's path and are not counted.
Each part also becomes Segments (gateway-side intervals) for the spans that show them. This module
must not do I/O nor know spans or messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STAGES = ("network", "preprocess", "queue", "forward", "decode")


@dataclass(frozen=True, slots=True)
class Call:
    """One client call to another service: perf_counter start and end, and the server's own time."""

    started: float
    ended: float
    server_ms: float

    @property
    def server_s(self) -> float:
        return min(max(self.server_ms, 0.0) / 1000.0, self.ended - self.started)

    @property
    def network_s(self) -> float:
        return max(0.0, self.ended - self.started - self.server_s)


@dataclass(frozen=True, slots=True)
class Segment:
    """A gateway-side interval given to one stage (perf_counter seconds), shown as one span."""

    stage: str
    start: float
    end: float
    hop: str = ""
    """For network: which hop (tokenize, worker, detokenize)."""


@dataclass(slots=True)
class StageClock:
    """A request's stages so far; the cursor is the end of the time already given out."""

    cursor: float
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    """Seconds per stage."""
    segments: list[Segment] = field(default_factory=list)

    def wait(self, stage: str, until: float) -> None:
        """Give [cursor, until] to `stage` (a queue, or the gateway's own work before a call)."""
        if until <= self.cursor:
            return
        self._give(stage, self.cursor, until)
        self.cursor = until

    def hop(self, call: Call, stage: str, hop: str) -> None:
        """A call: the wait before it began is queue, the server's time `stage`, the rest network.

        The network part is shown as two halves around the server's span (request, then response).
        """
        started = max(call.started, self.cursor)
        ended = max(call.ended, started)
        self.wait("queue", started)
        network = (ended - started) - min(call.server_s, ended - started)
        half = network / 2.0
        self._give("network", started, started + half, hop)
        self.parts[stage] += (ended - started) - network
        self._give("network", ended - half, ended, hop)
        self.cursor = ended

    def worker_attempt(
        self,
        *,
        submitted: float,
        ended: float,
        received: float | None,
        worker_queue_ms: float,
        worker_ms: float,
        detokenize: Call | None,
    ) -> None:
        """Give one attempt's time to network, the worker's queue and forward, and decode.

        The attempt was sent at `submitted` and its last delta (final or failure) taken up at `ended`;
        the message with its last update arrived at `received` (None when none arrived); the worker
        reported `worker_queue_ms` of queueing (its first update) and `worker_ms` in all up to its last
        update; `detokenize` is the last update's Detokenize call.
        """
        self.wait("queue", submitted)
        start = self.cursor
        ended = max(ended, start)
        if received is None:
            self._give("network", start, ended, "worker")
            self.cursor = ended
            return
        received = min(max(received, start), ended)
        on_worker = min(worker_ms / 1000.0, received - start)
        queued = min(worker_queue_ms / 1000.0, on_worker)
        self.parts["queue"] += queued
        self.parts["forward"] += on_worker - queued
        half = (received - start - on_worker) / 2.0
        self._give("network", start, start + half, "worker")
        self._give("network", received - half, received, "worker")
        detokenize_network = 0.0
        if detokenize is not None:
            detokenize_network = min(detokenize.network_s, ended - received)
        self._give("decode", received, ended - detokenize_network)
        self._give("network", ended - detokenize_network, ended, "detokenize")
        self.cursor = ended

    def milliseconds(self) -> dict[str, float]:
        return {stage: seconds * 1000.0 for stage, seconds in self.parts.items()}

    def _give(self, stage: str, start: float, end: float, hop: str = "") -> None:
        if end <= start:
            return
        self.parts[stage] += end - start
        self.segments.append(Segment(stage, start, end, hop))
