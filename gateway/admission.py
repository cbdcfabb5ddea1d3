"""Admission for one route: tickets, and the bounded two-priority queue of waiting slots.

A Ticket is what admission knows of a request: its prompt size, priority and deadline. It is decided
on at arrival, before tokenizing, so no refusal waits for the tokenizer: the prompt size is then an
upper bound (its UTF-8 bytes plus template overhead), replaced by the exact count once tokenized. The
queue holds the tickets waiting for a worker credit, interactive ones served first and FIFO within a
priority, bounded by `max_queued_requests` and `max_queued_tokens` (a lone slot always fits, so one
long prompt is never refused by the token budget alone). When it is full, an interactive arrival
evicts the newest batch tickets, which are refused with reason "shed".

Whether a ticket is admitted is the route's forecast of its time to first token
(forecast.py), which needs the tickets ahead of it in order: `ahead_tickets`. This module does no I/O
and must not choose links: route.py dispatches and decides, and credits.py counts the credits.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.status import ResourceExhausted
from strata.v1 import gateway_pb2

if TYPE_CHECKING:
    from gateway.credits import Slot

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

    def ahead_tickets(self, priority: Priority) -> list[Ticket]:
        """The waiting tickets a new ticket of this priority would wait behind, in the order served."""
        lanes = [Priority.INTERACTIVE] if priority is Priority.INTERACTIVE else list(Priority)
        return [slot.ticket for lane in lanes for slot in self._lanes[lane]]

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
