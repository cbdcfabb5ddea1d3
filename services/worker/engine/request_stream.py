"""One request's tokens as an async iterator, for callers that follow a single request.

The AsyncEngine pushes each of the request's step outputs (or the error that ended it) here, on the
event loop; iterating yields them until the finished one. A consumer that stops early aborts the
request. This module owns that hand-over; it must not touch the engine except through `abort`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from services.worker.engine.sequence import FinishReason, StepOutput

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable


class RequestStream:
    """The tokens of one request, as an async iterator of StepOutput; ends after the finished one."""

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        """abort: how the request is aborted in the engine (AsyncEngine.abort)."""
        self.request_id = request_id
        self._abort = abort
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def push(self, item: StepOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[StepOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StepOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            # A consumer that stops early (cancel, disconnect) must not leave the request running.
            if not self.finished:
                self._abort(self.request_id)

    def abort(self) -> None:
        self._abort(self.request_id)


def aborted_output(request_id: str) -> StepOutput:
    return StepOutput(
        request_id=request_id,
        new_token_ids=[],
        finished=True,
        finish_reason=FinishReason.ABORTED,
        num_prompt_tokens=0,
        num_output_tokens=0,
    )
