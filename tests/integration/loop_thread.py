"""An event loop in a daemon thread, and the stack of in-process servers on it that blocking tests
talk to.

LoopThread runs coroutines on its loop. A ServerStack owns a LoopThread, the servers started on it and
the blocking channels opened to them, and closes them together: the channels, then the servers
newest first (a gateway before the workers and the tokenizer service it links to), then the loop.
The harness modules subclass ServerStack with what they start; this module starts no server and
knows no service.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any, Self

import grpc

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


class ServerStack:
    """Servers on one loop thread and the channels tests opened to them; a context manager."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.servers: list[Any] = []
        """Every server started on the loop, oldest first; each has an async stop(grace)."""
        self.channels: list[grpc.Channel] = []

    def channel(self, address: str) -> grpc.Channel:
        """A blocking channel to `address` that close() closes."""
        channel = grpc.insecure_channel(address)
        self.channels.append(channel)
        return channel

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for server in reversed(self.servers):
            self.loop.run(server.stop(0))
        self.loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
