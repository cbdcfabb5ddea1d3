"""The forecast of a new request's time to first token on a route, from what its workers report.

Each worker stream has a LinkLoad: the requests open on it (prompt size, tokens still to generate,
whether the first token came) and the worker's steps, which every message on the stream reports
(StepInfo: an average of the steps' cadence, the engine's running limit and its prefill budget for the
batch now running). `forecast` replays the near future of a route with those facts: each running slot of
a link (the engine's running limit, at most the credits this gateway holds there) frees when the last
token of its request is due (tokens left x step time); the requests a link has queued beyond its slots,
then the tickets ahead in the route's queue, each take the earliest free slot and hold it for their
whole generation; the new ticket starts in the slot it gets, and its first token comes after the step it
waits for plus its prompt's prefill chunks, each priced by the stream's step-time model (step_cost.py, a
chunk's own price beside its tokens') once it is fitted, less what the reported steps already computed
of them and what the worker's prefix cache likely serves (each stream's CachedPrefixes,
prompt_prefix.py: a request's first update tells it the prompt is cached now, and how much of the guess
sent with it was right; how late first tokens still come feeds the margin as for any other error).
Prompts not yet prefilled on the worker count ahead of the ticket only when their worker priority is at
least the ticket's (the worker prefills a favoured tenant's prompt first, route.py), and a running
request of a lower priority gives its slot up at once (the worker preempts it). A request counts as
running to its max_new_tokens, so the forecast is an upper bound when requests stop early (the safe side
of the promise). `tenant_costs` is the work each tenant holds open on a stream, which its fair share
is measured against (fair_share.py). This module does no I/O and must not decide: route.py compares
the forecast with the SLO and the deadline, and worker_link.py feeds the LinkLoad.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.prompt_prefix import NO_PREFIX, CachedPrefixes, PromptPrefix
from gateway.step_cost import StepCost

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gateway.admission import Ticket
    from strata.v1 import worker_pb2

STEP_EWMA_WEIGHT = 0.3
"""Weight of each reported step in the step-time average: a few steps follow a change of load."""
MARGIN_SAMPLES = 200
MARGIN_MIN_SAMPLES = 20
MARGIN_AGE_S = 10.0
"""Seconds a first token's lateness counts in the margin. Only admitted requests teach it, so without an
age a margin learnt in one bad moment refused every request after it and never heard otherwise."""
MARGIN_QUANTILE = 0.95


@dataclass(slots=True)
class _Open:
    """One request open on a stream, as the forecast sees it."""

    prompt_tokens: int
    max_new_tokens: int
    output_tokens: int
    tenant: str = ""
    priority: int = 0
    """Its Submission.priority: the worker prefills higher ones first."""
    prefilled: int = 0
    """Prompt tokens the reported steps computed for it, by the order the worker prefills in."""
    started: bool = False
    """Its first token came: it holds a running slot and only decodes."""
    due: float | None = None
    """When admission forecast its first token (time.monotonic(), the margin left out); None: no forecast."""
    prefix: PromptPrefix = NO_PREFIX
    cached: int = 0
    """Prompt tokens the stream's CachedPrefixes guessed the worker's cache serves, when it was sent."""


class LinkLoad:
    """One worker stream's open requests and step times. Used from the event loop only."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}
        self.step_s: float | None = None
        """Moving average of the worker's step durations; None before its first step."""
        self.max_running = 0
        """The engine's running limit at its last step; 0 before any."""
        self.prefill_budget = 0
        """Prompt tokens a step may compute with the batch now running; 0 before any step."""
        self._provisional = False
        """step_s is the hello's step (often the warm-up's, a batch of one): the next replaces it."""
        self._last: tuple[int, float, bool] | None = None
        """The last step report: its number, when it arrived, and whether the engine was still busy."""
        self.running = 0
        """Requests the engine ran in its last step."""
        self.cost = StepCost()
        self.cache = CachedPrefixes()
        """The prompts the worker prefilled lately: what of a new one its prefix cache likely holds."""
        self._errors: deque[tuple[float, float]] = deque(maxlen=MARGIN_SAMPLES)
        """(when, seconds) each recent first token came after its forecast (negative: before)."""
        self._margin: float | None = None

    @property
    def open_requests(self) -> int:
        return len(self._open)

    def clear(self) -> None:
        """A new stream: nothing of the old one runs any more (its step numbers may restart too)."""
        self._open.clear()
        self._last = None
        self.cost.clear()
        self.cache.clear()

    def sent(
        self,
        submission: worker_pb2.Submission,
        due: float | None = None,
        tenant: str = "",
        prefix: PromptPrefix = NO_PREFIX,
    ) -> None:
        """A submission of `tenant` was queued for the worker; `due` is when its first token was
        forecast for, `prefix` its prompt's piece hashes. The part of its prompt the worker likely has
        cached counts as prefilled already."""
        prompt_tokens = len(submission.prompt_ids) + len(submission.prior_output_ids)
        cached = min(self.cache.cached_tokens(prefix), prompt_tokens - 1)
        self._open[submission.request_id] = _Open(
            prompt_tokens=prompt_tokens,
            max_new_tokens=submission.sampling.max_new_tokens,
            output_tokens=len(submission.prior_output_ids),
            tenant=tenant,
            priority=submission.priority,
            due=due,
            prefix=prefix,
            cached=max(0, cached),
            prefilled=max(0, cached),
        )

    def tenant_costs(self) -> dict[str, int]:
        """The token cost (prompt plus max_new_tokens) of the requests open on this stream, by tenant:
        what a tenant's fair share is measured against (fair_share.py)."""
        costs: dict[str, int] = {}
        for request in self._open.values():
            cost = request.prompt_tokens + request.max_new_tokens
            costs[request.tenant] = costs.get(request.tenant, 0) + cost
        return costs

    @property
    def margin_s(self) -> float:
        """How late first tokens came against their forecast on this stream, lately: the
        MARGIN_QUANTILE of the last MARGIN_SAMPLES errors within MARGIN_AGE_S seconds of worker
        messages (0 while fewer than MARGIN_MIN_SAMPLES, or when they came early). The forecast adds
        it: what the replay cannot see (a neighbour taking the cores, the gateway's own lag) shows up
        here, and leaves again when it passes."""
        if self._margin is None:
            errors = sorted(error for _, error in self._errors)
            if len(errors) < MARGIN_MIN_SAMPLES:
                self._margin = 0.0
            else:
                self._margin = max(0.0, errors[min(len(errors) - 1, int(MARGIN_QUANTILE * len(errors)))])
        return self._margin

    def forget(self, wire_id: str) -> None:
        """The request ended or was cancelled: its slot is free."""
        self._open.pop(wire_id, None)

    def observe(self, response: worker_pb2.ConnectResponse, now: float) -> None:
        """Follow a worker message received at `now` (time.monotonic()): rejections, progress and ends
        of requests, and the step."""
        for rejection in response.rejections:
            self.forget(rejection.request_id)
        while self._errors and self._errors[0][0] < now - MARGIN_AGE_S:
            self._errors.popleft()
            self._margin = None
        if response.HasField("hello"):
            memory = response.hello.info.memory
            self.cache.size(memory.kv_tokens, memory.kv_blocks)
        if response.HasField("step"):
            # Before the updates: the prompts this step finished were still unstarted when it ran.
            self._prefilled(response.step.prefill_tokens)
        for update in response.updates:
            request = self._open.get(update.request_id)
            if request is not None and not request.started:
                # Its prompt is in the worker's cache now; and the guess sent with it is checked.
                self.cache.prefilled(request.prefix, request.prompt_tokens)
                self.cache.confirmed(request.cached, update.cached_prompt_tokens)
            if update.finished:
                self.forget(update.request_id)
                continue
            if request is not None:
                if not request.started and request.due is not None:
                    self._errors.append((now, now - request.due))
                    self._margin = None
                request.output_tokens = max(request.output_tokens, update.output_tokens)
                request.started = True
        if response.HasField("step"):
            self._stepped(response.step, now, provisional=response.HasField("hello"))

    def _prefilled(self, tokens: int) -> None:
        """A step computed `tokens` of prefill: credit them to the unstarted prompts in the order the
        worker takes them (higher priority first, then as sent). Merged messages report only their
        newest step, so the progress seen is at most the real one: the forecast stays on the safe side."""
        waiting = [r for r in self._open.values() if not r.started]
        for request in sorted(waiting, key=lambda r: -r.priority):
            take = min(tokens, request.prompt_tokens - request.prefilled)
            request.prefilled += take
            tokens -= take
            if tokens <= 0:
                return

    def _stepped(self, step: worker_pb2.StepInfo, now: float, *, provisional: bool) -> None:
        # A request waits for the steps' cadence, not only their forward passes: between two steps the
        # worker applies its inbox and sends its messages, and on shared cores it waits for them. So a
        # step's time is the wall time per step between two reports of a busy engine; after an idle
        # engine (or for the first report) it is the step's own duration.
        seconds = step.duration_ms / 1000.0
        last = self._last
        if last is not None and last[2] and step.step > last[0]:
            seconds = max(seconds, (now - last[1]) / (step.step - last[0]))
        previous = None if self._provisional else self.step_s
        self.step_s = seconds if previous is None else previous + STEP_EWMA_WEIGHT * (seconds - previous)
        self._provisional = provisional
        self._last = (step.step, now, step.running > 0)
        self.running = step.running
        self.cost.add(step.decodes, step.prefill_tokens, seconds)
        self.max_running = step.max_running
        self.prefill_budget = step.prefill_budget

    def slots(self, credit_limit: int) -> int:
        """Requests the engine runs at once for this stream: its running limit, at most the credits."""
        return min(credit_limit, self.max_running) if self.max_running else credit_limit

    def chunks(self, prompt_tokens: int) -> int:
        """Steps the prefill of `prompt_tokens` takes at the current budget (at least one)."""
        return max(1, math.ceil(prompt_tokens / max(1, self.prefill_budget or prompt_tokens)))

    def prefill_s(self, prompt_tokens: int) -> float:
        """Seconds the steps computing `prompt_tokens` of prefill take, at the current batch: priced by
        the step-time model (each chunk's step its fixed part, its decodes and what computing any
        prefill costs it, plus the tokens), else the average step per chunk."""
        chunks = self.chunks(prompt_tokens)
        fit = self.cost.coefficients
        if fit is None:
            return chunks * (self.step_s or 0.0)
        fixed, per_decode, per_token = fit
        return chunks * (fixed + per_decode * self.running + self.cost.per_chunk) + per_token * prompt_tokens

    def busy_until(
        self, slots: int, unsent: Sequence[_Open] = (), priority: int = 0, credit: bool = True
    ) -> tuple[list[float], list[_Open], int]:
        """(seconds until each occupied slot frees for a prompt of `priority`, the requests queued
        behind the slots that the worker admits before it, in order, the prompt tokens still to prefill
        in the slots that the worker computes before it), with `unsent` requests granted a credit here
        and about to be sent after the open ones. The worker admits its queue by priority, and a prompt
        of a higher priority than a request holding a slot takes that slot (the worker preempts it:
        services/worker/engine/yielding.py) as soon as it reaches the worker: at once when it has a
        `credit` here, else when the first request here ends and frees one. Only for a link with a
        step time."""
        step_s = self.step_s or 0.0
        ordered = [*self._open.values(), *unsent]
        ordered.sort(key=lambda r: not r.started)  # running ones hold slots first, the rest in order
        held, queued = ordered[:slots], [r for r in ordered[slots:] if r.priority >= priority]
        ends = []
        pending_prefill = 0
        for request in held:
            left = max(1, request.max_new_tokens - request.output_tokens)
            if not request.started:
                if request.priority >= priority:
                    pending_prefill += request.prompt_tokens - request.prefilled
                left += self.chunks(request.prompt_tokens - request.prefilled)
            ends.append(left * step_s)
        reached = 0.0 if credit or not ends else min(ends)
        frees = [
            min(end, reached) if request.priority < priority else end
            for request, end in zip(held, ends, strict=True)
        ]
        return frees, queued, pending_prefill


@dataclass(frozen=True, slots=True)
class LinkView:
    """What the forecast needs of one ready link."""

    load: LinkLoad
    slots: int
    """Running slots for this stream (LinkLoad.slots)."""
    free_credits: int
    """Credits this gateway may still use on it: empty slots beyond these belong to other gateways."""
    unsent: Sequence[Ticket] = ()
    """The tickets of slots granted on it whose submissions are not sent yet (being tokenized)."""
    priority: int = 0
    """The Submission.priority the ticket would have on it (fair_share.py's worker_priority)."""
    cached_tokens: int = 0
    """Of the ticket's prompt, the tokens this worker's prefix cache likely serves (CachedPrefixes)."""


@dataclass(frozen=True, slots=True)
class Forecast:
    """When the ticket would start in a slot, and when its first token would come, in seconds from now."""

    start_s: float
    ttft_s: float
    """The replay's time to first token plus the link's margin."""
    margin_s: float = 0.0
    """The part of ttft_s that is the link's recent lateness (LinkLoad.margin_s)."""
    priced: bool = False
    """The link's step-time model priced the prefill. An unpriced forecast (a worker's first few
    steps) is a cold guess: how late it comes says nothing of the replay's error, so the margin does
    not learn from it."""


def forecast(links: Sequence[LinkView], ahead: Sequence[Ticket], ticket: Ticket) -> Forecast | None:
    """The ticket's start and first token behind `ahead`; None when no link has reported a step yet."""
    # Free-slot events: (seconds from now, link index); the earliest is taken first.
    events: list[tuple[float, int]] = []
    pending: dict[int, int] = {}
    for index, view in enumerate(links):
        load = view.load
        if load.step_s is None:
            continue
        unsent = [_Open(t.prompt_tokens, t.max_new_tokens, 0, priority=view.priority) for t in view.unsent]
        frees, queued, pending[index] = load.busy_until(
            view.slots, unsent, view.priority, view.free_credits > 0
        )
        empty = max(0, min(view.slots - len(frees), view.free_credits))
        # The requests a worker queues behind its slots wait for that worker's slots only.
        own = [(at, index) for at in frees + [0.0] * empty]
        heapq.heapify(own)
        for request in queued:
            if own:
                _hold(own, request.max_new_tokens - request.output_tokens, request.prompt_tokens, load)
        events.extend(own)
    if not events:
        return None
    heapq.heapify(events)
    starts = [
        (_hold(events, waiting.max_new_tokens, waiting.prompt_tokens, links[events[0][1]].load), waiting)
        for waiting in ahead
    ]
    start, index = events[0]
    load = links[index].load
    step_s = load.step_s or 0.0
    # Prompts that start in the same step or the one before (slots often free together: requests
    # admitted in one burst end in one) share the prefill budget of the steps that follow; so do the
    # prompts not yet prefilled when the ticket starts now.
    prompt = max(1, ticket.prompt_tokens - links[index].cached_tokens)
    prompt += pending.get(index, 0) if start <= step_s else 0
    prompt += sum(t.prompt_tokens for (at, i), t in starts if i == index and at >= start - step_s)
    margin = load.margin_s
    priced = load.cost.coefficients is not None
    return Forecast(start, start + step_s + load.prefill_s(prompt) + margin, margin, priced)


def _hold(
    events: list[tuple[float, int]], new_tokens: int, prompt_tokens: int, load: LinkLoad
) -> tuple[float, int]:
    """The earliest free slot of `events` (on `load`'s link) runs one request through, then frees;
    returns (when it started, the link index)."""
    at, index = heapq.heappop(events)
    steps = max(1, new_tokens) + load.chunks(prompt_tokens)
    heapq.heappush(events, (at + steps * (load.step_s or 0.0), index))
    return at, index
