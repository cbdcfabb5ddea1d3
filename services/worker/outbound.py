"""One Connect stream's outbound queue: what the worker has to say, merged while a write is in flight.

The engine's step loop (through the event loop) puts token updates, rejections and credits here and
never waits; the stream's writer takes everything pending as one ConnectResponse each time its
previous write finished. A slow reader therefore sees fewer, larger messages, never a growing backlog
of small ones: tokens of the same request are concatenated and the newest counters, credits and step win.
This module must not touch gRPC calls nor the engine; it only builds and merges messages.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from strata.v1 import worker_pb2

if TYPE_CHECKING:
    from collections.abc import Iterable


def merge_update(into: worker_pb2.TokenUpdate, later: worker_pb2.TokenUpdate) -> None:
    """Fold a later update of the same request into an earlier, not yet sent one."""
    into.token_ids.extend(later.token_ids)
    into.logprobs.extend(later.logprobs)
    into.prompt_logprobs.extend(later.prompt_logprobs)
    into.finished = later.finished
    into.finish_reason = later.finish_reason
    into.prompt_tokens = later.prompt_tokens
    into.output_tokens = later.output_tokens
    # queue_ms belongs to the request's first update, which is the earlier one when it has it.
    if not into.queue_ms:
        into.queue_ms = later.queue_ms
    into.forward_ms = later.forward_ms
    # Every update carries the prefix cache's count, and the last one the device's memory.
    into.cached_prompt_tokens = later.cached_prompt_tokens
    if later.device_memory_bytes:
        into.device_memory_bytes = later.device_memory_bytes
    # Drafts are counted per step: the merged update reports both steps'.
    into.draft_tokens += later.draft_tokens
    into.accepted_draft_tokens += later.accepted_draft_tokens


class OutboundQueue:
    """Pending output of one stream, taken as one merged message at a time."""

    def __init__(self) -> None:
        self._hello: worker_pb2.WorkerHello | None = None
        self._updates: list[worker_pb2.TokenUpdate] = []
        # Request id -> index in _updates of its entry still open to merging (not finished).
        self._mergeable: dict[str, int] = {}
        self._rejections: list[worker_pb2.Rejection] = []
        self._credits: worker_pb2.Credits | None = None
        self._step: worker_pb2.StepInfo | None = None
        self._closed = False
        self._wakeup = asyncio.Event()

    @property
    def pending(self) -> bool:
        return bool(
            self._hello is not None
            or self._updates
            or self._rejections
            or self._credits is not None
            or self._step is not None
        )

    def put(
        self,
        *,
        hello: worker_pb2.WorkerHello | None = None,
        updates: Iterable[worker_pb2.TokenUpdate] = (),
        rejections: Iterable[worker_pb2.Rejection] = (),
        credits: worker_pb2.Credits | None = None,
        step: worker_pb2.StepInfo | None = None,
    ) -> None:
        """Queue output; the queue owns the messages given. Ignored once the queue is closed."""
        if self._closed:
            return
        if hello is not None:
            self._hello = hello
        for update in updates:
            index = self._mergeable.get(update.request_id)
            if index is not None:
                merge_update(self._updates[index], update)
                if update.finished:
                    del self._mergeable[update.request_id]
                continue
            # A finished entry is sealed: a later request reusing the id gets its own entry after it.
            if not update.finished:
                self._mergeable[update.request_id] = len(self._updates)
            self._updates.append(update)
        self._rejections.extend(rejections)
        if credits is not None:
            self._credits = credits
        if step is not None:
            self._step = step
        if self.pending:
            self._wakeup.set()

    def take(self) -> worker_pb2.ConnectResponse | None:
        """Everything pending as one message, or None when nothing is."""
        if not self.pending:
            return None
        message = worker_pb2.ConnectResponse(
            hello=self._hello,
            updates=self._updates,
            rejections=self._rejections,
            credits=self._credits,
            step=self._step,
        )
        self._hello = None
        self._updates = []
        self._mergeable = {}
        self._rejections = []
        self._credits = None
        self._step = None
        self._wakeup.clear()
        return message

    async def get(self) -> worker_pb2.ConnectResponse | None:
        """Wait for the next merged message; None once the queue is closed and drained."""
        while True:
            message = self.take()
            if message is not None:
                return message
            if self._closed:
                return None
            await self._wakeup.wait()

    def close(self) -> None:
        """No more output: get() returns what is pending, then None."""
        self._closed = True
        self._wakeup.set()
