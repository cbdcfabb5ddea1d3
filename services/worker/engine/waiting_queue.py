"""The scheduler's waiting queue: sequences not running, in the order they will be admitted.

The order is priority first, then preempted sequences (most recently preempted first, so a victim
resumes before anyone who arrived after it), then arrival. This module only keeps that order: it
must not decide who is admitted (scheduler.py does) nor touch KV blocks.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

    from services.worker.engine.sequence import Sequence

QueueKey = tuple[int, int, int]
"""(priority, 0 for a preempted sequence or 1 for a new one, preemption or arrival order)."""


class WaitingQueue:
    """Waiting sequences sorted by QueueKey; insertion keeps ties in insertion order."""

    def __init__(self) -> None:
        self._items: list[tuple[QueueKey, Sequence]] = []

    def push_new(self, seq: Sequence) -> None:
        """A new arrival: behind everyone of its priority who came before it."""
        self._insert((seq.priority, 1, seq.arrival), seq)

    def push_preempted(self, seq: Sequence, order: int) -> None:
        """A preempted sequence (`order` counts preemptions): ahead of its priority's arrivals."""
        self._insert((seq.priority, 0, -order), seq)

    def _insert(self, key: QueueKey, seq: Sequence) -> None:
        bisect.insort(self._items, (key, seq), key=lambda item: item[0])

    def peek(self) -> Sequence:
        return self._items[0][1]

    def pop(self) -> Sequence:
        return self._items.pop(0)[1]

    def remove(self, seq: Sequence) -> None:
        self._items = [item for item in self._items if item[1] is not seq]

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for _, seq in self._items)
