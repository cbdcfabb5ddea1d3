"""An event loop in a daemon thread, for in-process servers that blocking tests talk to."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine


class LoopThread:
    """Runs coroutines (and plain functions) on one event loop in its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, function: Callable[[], Any]) -> Any:
        """Run a plain function on the loop's thread (the servers are not thread-safe)."""

        async def wrapper() -> Any:
            return function()

        return self.run(wrapper())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
