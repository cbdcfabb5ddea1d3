"""What admission knows of a request: its Ticket, its Priority, its likely prompt size, and Refused.

A Ticket is decided on at arrival, before tokenizing, so no refusal waits for the tokenizer: the prompt
size is then an upper bound (its UTF-8 bytes plus template overhead), replaced by the exact count once
tokenized. Its cost (prompt plus max_new_tokens) is what fair queuing charges its tenant
(admission_queue.py). The bound suits budgets but not forecasts (English text has several bytes a
token, so the bound is several times the count): PromptEstimate learns the route's ratio of exact
counts to bounds, and the forecast prices a prompt not yet tokenized at its bound times it. Whether a
ticket is admitted is the route's forecast of its time to first token (forecast.py). This module does
no I/O and must not queue tickets nor choose links.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from gateway.prompt_prefix import NO_PREFIX, PromptPrefix
from gateway.tenant_settings import DEFAULT_TENANT
from strata.status import ResourceExhausted
from strata.v1 import gateway_pb2

# Tokens a chat template adds around each message, and around the conversation, at most.
TEMPLATE_TOKENS_PER_MESSAGE = 16


class Priority(enum.IntEnum):
    """Admission order: interactive first; batch is shed first."""

    INTERACTIVE = 0
    BATCH = 1

    def worker_priority(self, favoured: bool = False) -> int:
        """Submission.priority (higher runs first in the worker's engine): interactive 0, batch -2, one
        more when `favoured` (its tenant is below its fair share on the worker), never past the class
        above."""
        return (0 if self is Priority.INTERACTIVE else -2) + favoured


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
    tenant: str = DEFAULT_TENANT
    prefix: PromptPrefix = NO_PREFIX
    """The prompt's piece hashes: what of it a worker's prefix cache likely holds (prompt_prefix.py)."""

    @property
    def cost(self) -> int:
        """What serving it costs, in tokens: its prompt plus the most it may generate."""
        return self.prompt_tokens + self.max_new_tokens

    def remaining_s(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now


PROMPT_RATIO_WEIGHT = 0.1
"""Weight of each tokenized prompt in the moving ratio of exact counts to bounds."""


class PromptEstimate:
    """A route's moving ratio of prompts' exact token counts to their bounds (1 before any)."""

    def __init__(self) -> None:
        self.ratio = 1.0

    def observe(self, bound: int, exact: int) -> None:
        if bound > 0:
            sample = min(1.0, exact / bound)
            self.ratio += PROMPT_RATIO_WEIGHT * (sample - self.ratio)

    def expected(self, bound: int) -> int:
        """The tokens a prompt bounded at `bound` likely has (at least one)."""
        return max(1, round(bound * self.ratio))


class Refused(ResourceExhausted):
    """Refused at admission, at once; `reason` is the refusals metric's label."""

    def __init__(self, message: str, retry_after_s: float, reason: str) -> None:
        super().__init__(message, retry_after_s)
        self.reason = reason
