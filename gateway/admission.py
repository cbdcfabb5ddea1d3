"""Admission for one route: tickets, the bounded two-priority queue of waiting slots, and the wait model.

A Ticket is what admission knows of a request: its prompt size, priority and deadline. It is decided
on at arrival, before tokenizing, so no refusal waits for the tokenizer: the prompt size is then an
upper bound (its UTF-8 bytes plus template overhead), replaced by the exact count once tokenized. The
queue holds the tickets waiting for a worker credit, interactive ones served first and FIFO within a
priority, bounded by `max_queued_requests` and `max_queued_tokens` (a lone slot always fits, so one
long prompt is never refused by the token budget alone). When it is full, an interactive arrival
evicts the newest batch tickets, which are refused with reason "shed".

The wait model follows Little's law: a worker holding C requests that each take D seconds from
submission to their last token (a moving average the links measure on every request) frees a credit
every D / C seconds, and a route frees one every 1 / sum(C / D) over its ready links. A ticket with k
tickets ahead of it and no free credit is predicted to wait (k + 1) times that. Before any request
has finished there is no prediction, and nothing is refused on one. The predicted time to first token
adds the links' moving average of submission to first token (ServiceTimes, fed by each link). Only a
ticket that would wait can be saturated by a prediction: one that gets a credit at once is admitted,
so the measurements stay fresh. This module does no I/O and must not choose links: route.py
dispatches, and credits.py counts the credits.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.status import ResourceExhausted
from strata.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from gateway.credits import Slot
    from strata.v1 import worker_pb2

# Tokens a chat template adds around each message, and around the conversation, at most.
TEMPLATE_TOKENS_PER_MESSAGE = 16
EWMA_WEIGHT = 0.2
COMPLETED = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


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


class AdmissionQueue:
    """Waiting slots by priority, FIFO within each, with their request and token totals."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._lanes: dict[Priority, deque[Slot]] = {priority: deque() for priority in Priority}
        self.tokens = 0

    @property
    def requests(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    def ahead(self, priority: Priority) -> int:
        """How many waiting tickets a new ticket of this priority would wait behind."""
        if priority is Priority.INTERACTIVE:
            return len(self._lanes[Priority.INTERACTIVE])
        return self.requests

    def victims(self, ticket: Ticket) -> list[Slot] | tuple[str, str]:
        """The batch slots to shed so `ticket` fits (often none), or (reason, text) when it cannot fit."""
        count, tokens = self.requests, self.tokens
        shed: list[Slot] = []
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

    def push(self, slot: Slot) -> None:
        self._lanes[slot.ticket.priority].append(slot)
        self.tokens += slot.tokens

    def remove(self, slot: Slot) -> bool:
        """Take a slot out (cancelled, expired, shed); False when it was not waiting."""
        lane = self._lanes[slot.ticket.priority]
        try:
            lane.remove(slot)
        except ValueError:
            return False
        self.tokens -= slot.tokens
        return True

    def pop_next(self) -> Slot | None:
        """The next slot to serve: the oldest interactive one, else the oldest batch one."""
        for priority in Priority:
            lane = self._lanes[priority]
            if lane:
                slot = lane.popleft()
                self.tokens -= slot.tokens
                return slot
        return None

    def set_tokens(self, slot: Slot, tokens: int) -> None:
        """The exact prompt size, once tokenized, replaces the estimate in the totals."""
        if slot in self._lanes[slot.ticket.priority]:
            self.tokens += tokens - slot.tokens
        slot.tokens = tokens

    def clear(self) -> list[Slot]:
        """Empty the queue, returning every slot (oldest interactive first)."""
        slots = [slot for priority in Priority for slot in self._lanes[priority]]
        for lane in self._lanes.values():
            lane.clear()
        self.tokens = 0
        return slots


def predicted_wait_s(ahead: int, free_credits: int, per_grant_s: float | None) -> float | None:
    """The wait behind `ahead` tickets with `free_credits` free; None when the rate is not known yet."""
    if ahead < free_credits:
        return 0.0
    if per_grant_s is None:
        return None
    return (ahead - free_credits + 1) * per_grant_s


def ewma(previous: float | None, sample: float) -> float:
    return sample if previous is None else previous + EWMA_WEIGHT * (sample - previous)


class ServiceTimes:
    """How long one worker stream's requests take: submission to first update, and to the last one."""

    def __init__(self) -> None:
        self._sent_at: dict[str, float] = {}
        self._waiting_first: set[str] = set()
        self.first_token_s: float | None = None
        """Moving average of the seconds from submission to a request's first update."""
        self.service_s: float | None = None
        """Moving average of the seconds from submission to a completed request's last update."""

    def clear(self) -> None:
        """A new stream: nothing of the old one is still on its way."""
        self._sent_at.clear()
        self._waiting_first.clear()

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
            wire_id = update.request_id
            sent = self._sent_at.get(wire_id)
            if sent is None:
                continue
            if wire_id in self._waiting_first:
                self._waiting_first.discard(wire_id)
                self.first_token_s = ewma(self.first_token_s, now - sent)
            if update.finished:
                del self._sent_at[wire_id]
                if update.finish_reason in COMPLETED:  # an aborted request says nothing of the rate
                    self.service_s = ewma(self.service_s, now - sent)
