"""Admission for one route: tickets, the bounded two-priority queue, the wait model, and the
Admission handle a request holds from arrival until it is submitted.

A Ticket is what admission knows of a request: its prompt size, priority and deadline. It is decided
on at arrival, before tokenizing, so no refusal waits for the tokenizer: the prompt size is then an
upper bound (its UTF-8 bytes plus template overhead), replaced by the exact count once tokenized. The
queue holds the tickets waiting for a worker credit, interactive ones served first and FIFO within a
priority, bounded by `max_queued_requests` and `max_queued_tokens` (a lone waiter always fits, so one
long prompt is never refused by the token budget alone). When it is full, an interactive arrival
evicts the newest batch tickets, which are refused with reason "shed".

The wait model follows Little's law: a worker holding C requests that each take D seconds from
submission to their last token (a moving average the links measure on every request) frees a credit
every D / C seconds, and a route frees one every 1 / sum(C / D) over its ready links. A ticket with k
tickets ahead of it and no free credit is predicted to wait (k + 1) times that. Before any request
has finished there is no prediction, and nothing is refused on one. The predicted time to first token
adds the links' moving average of submission to first token. Only a ticket that would wait can be
saturated by a prediction: one that gets a credit at once is admitted, so the measurements stay fresh.
This module does no I/O and must not choose links: route.py dispatches.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from strata.status import ResourceExhausted
from strata.v1 import gateway_pb2

if TYPE_CHECKING:
    from gateway.request_state import OpenRequest
    from gateway.worker_link import WorkerLink
    from strata.v1 import worker_pb2

# Tokens a chat template adds around each message, and around the conversation, at most.
TEMPLATE_TOKENS_PER_MESSAGE = 16


class Priority(enum.IntEnum):
    """Admission order: interactive first; batch is shed first."""

    INTERACTIVE = 0
    BATCH = 1

    @property
    def worker_priority(self) -> int:
        """Submission.priority: higher runs first in the worker's engine."""
        return 0 if self is Priority.INTERACTIVE else -1


def priority_of(value: gateway_pb2.Priority.ValueType) -> Priority:
    """The admission priority of GenerateRequest.priority (UNSPECIFIED is interactive)."""
    return Priority.BATCH if value == gateway_pb2.PRIORITY_BATCH else Priority.INTERACTIVE


def deadline_from_unix_ms(deadline_unix_ms: int) -> float | None:
    """A wall-clock deadline (0: none) as a time.monotonic() deadline."""
    if not deadline_unix_ms:
        return None
    return time.monotonic() + (deadline_unix_ms / 1000.0 - time.time())


def estimate_prompt_tokens(request: gateway_pb2.GenerateRequest) -> int:
    """An upper bound on the prompt's tokens before tokenizing: its UTF-8 bytes plus template overhead.

    Byte-level tokenizers never make more tokens than bytes; the estimate only bounds the token
    budget until the exact count replaces it, so refusing on it never waits for the tokenizer.
    """
    size = len(request.prompt.encode())
    for message in request.messages:
        size += len(message.content.encode()) + len(message.role) + TEMPLATE_TOKENS_PER_MESSAGE
    return size + TEMPLATE_TOKENS_PER_MESSAGE


@dataclass(frozen=True, slots=True)
class Ticket:
    """What admission knows of one request."""

    request_id: str
    prompt_tokens: int
    """Exact once tokenized; before, an upper bound (estimate_prompt_tokens)."""
    max_new_tokens: int
    priority: Priority = Priority.INTERACTIVE
    deadline: float | None = None
    """time.monotonic() deadline; None when the call has none."""

    def remaining_s(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now


class Refused(ResourceExhausted):
    """Refused at admission, at once; `reason` is the refusals metric's label."""

    def __init__(self, message: str, retry_after_s: float, reason: str) -> None:
        super().__init__(message, retry_after_s)
        self.reason = reason


@dataclass(eq=False, slots=True)
class Waiter:
    """A ticket in the queue (or just granted): its current token count and the future its caller awaits."""

    ticket: Ticket
    future: asyncio.Future[WorkerLink]
    tokens: int
    enqueued: float = field(default_factory=time.monotonic)
    timer: asyncio.TimerHandle | None = None
    """Fires at the ticket's deadline while it waits."""


class AdmissionQueue:
    """Waiting tickets by priority, FIFO within each, with their request and token totals."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._lanes: dict[Priority, deque[Waiter]] = {priority: deque() for priority in Priority}
        self.tokens = 0

    @property
    def requests(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    def ahead(self, priority: Priority) -> int:
        """How many waiting tickets a new ticket of this priority would wait behind."""
        if priority is Priority.INTERACTIVE:
            return len(self._lanes[Priority.INTERACTIVE])
        return self.requests

    def victims(self, ticket: Ticket) -> list[Waiter] | tuple[str, str]:
        """The batch waiters to shed so `ticket` fits (often none), or (reason, text) when it cannot fit."""
        count, tokens = self.requests, self.tokens
        shed: list[Waiter] = []
        sheddable = (
            reversed(self._lanes[Priority.BATCH]) if ticket.priority is Priority.INTERACTIVE else iter(())
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

    def push(self, waiter: Waiter) -> None:
        self._lanes[waiter.ticket.priority].append(waiter)
        self.tokens += waiter.tokens

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter out (cancelled, expired, shed); False when it was not waiting."""
        lane = self._lanes[waiter.ticket.priority]
        try:
            lane.remove(waiter)
        except ValueError:
            return False
        self.tokens -= waiter.tokens
        return True

    def pop_next(self) -> Waiter | None:
        """The next waiter to serve: the oldest interactive one, else the oldest batch one."""
        for priority in Priority:
            lane = self._lanes[priority]
            if lane:
                waiter = lane.popleft()
                self.tokens -= waiter.tokens
                return waiter
        return None

    def set_tokens(self, waiter: Waiter, tokens: int) -> None:
        """The exact prompt size, once tokenized, replaces the estimate in the totals."""
        if waiter in self._lanes[waiter.ticket.priority]:
            self.tokens += tokens - waiter.tokens
        waiter.tokens = tokens

    def clear(self) -> list[Waiter]:
        """Empty the queue, returning every waiter (oldest interactive first)."""
        waiters = [waiter for priority in Priority for waiter in self._lanes[priority]]
        for lane in self._lanes.values():
            lane.clear()
        self.tokens = 0
        return waiters


def predicted_wait_s(ahead: int, free_credits: int, per_grant_s: float | None) -> float | None:
    """The wait behind `ahead` tickets with `free_credits` free; None when the rate is not known yet."""
    if ahead < free_credits:
        return 0.0
    if per_grant_s is None:
        return None
    return (ahead - free_credits + 1) * per_grant_s


class Queue(Protocol):
    """What an Admission needs of its route."""

    def set_tokens(self, waiter: Waiter, tokens: int) -> None: ...

    def withdraw(self, waiter: Waiter) -> None: ...


class Admission:
    """One request's place at a route, from arrival until it is submitted or given up."""

    def __init__(self, route: Queue, waiter: Waiter) -> None:
        self._route = route
        self._waiter = waiter
        self._done = False

    @property
    def ticket(self) -> Ticket:
        return self._waiter.ticket

    async def granted(self, prompt_tokens: int | None = None) -> WorkerLink:
        """Wait for a credit (the exact prompt size replaces the estimate); the link it is reserved on.

        Raises Refused ("shed"), DeadlineExceeded or Unavailable when the ticket leaves the queue.
        """
        if prompt_tokens is not None:
            self._route.set_tokens(self._waiter, prompt_tokens)
        try:
            return await self._waiter.future
        except asyncio.CancelledError:
            self.close()
            raise

    def submit(self, submission: worker_pb2.Submission, stop: tuple[str, ...]) -> OpenRequest:
        """Submit on the granted link, using the credit reserved for this request."""
        link = self._waiter.future.result()
        self._done = True
        return link.submit(submission, stop)

    def hand_over(self) -> WorkerLink:
        """The granted link; its reserved credit now belongs to the caller's next `link.submit`."""
        link = self._waiter.future.result()
        self._done = True
        return link

    def close(self) -> None:
        """Give up the place or the reserved credit, whichever the request holds; idempotent."""
        if self._done:
            return
        self._done = True
        future = self._waiter.future
        self._route.withdraw(self._waiter)
        if not future.done():
            future.cancel()
        elif not future.cancelled() and future.exception() is None:
            future.result().release()

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
