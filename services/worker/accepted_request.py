"""One request a Connect stream accepted and the engine runs: what the stream reports about it.

This module holds the record only; connection.py creates, updates and forgets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

    from services.worker.request_spans import RequestSpans


@dataclass(slots=True)
class AcceptedRequest:
    """A request accepted on this stream and not yet finished."""

    request_id: str
    engine_id: str
    prompt_tokens: int
    """The submission's prompt_ids, without any prior output."""
    prior_tokens: int
    """prior_output_ids of a failover: prefilled by the engine, counted as output, never sent back."""
    submitted: float
    """time.monotonic() at arrival."""
    first_step: float | None = None
    """time.monotonic() at the start of the first step that produced one of its tokens."""
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens the prefix cache served, as the engine's updates report them."""
    deadline: asyncio.TimerHandle | None = None
    spans: RequestSpans | None = None
    """Its trace state; None when untraced."""

    def forward_ms(self, now: float) -> float:
        return 0.0 if self.first_step is None else (now - self.first_step) * 1000.0
