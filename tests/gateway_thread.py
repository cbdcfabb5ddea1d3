"""A fake gateway servicer served on a free port from its own thread and event loop, for the benchmark
tests: the code under test (a benchmark) runs its own event loop and its own gRPC client. The fake
stands in for the gateway where a test checks what the benchmark sends and how it reduces answers,
not the gateway itself (the real stack's tests do that)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from typing import TYPE_CHECKING

import grpc

from strata.v1 import gateway_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Iterator


@contextlib.contextmanager
def serving_in_a_thread(servicer: gateway_pb2_grpc.GatewayServicer) -> Iterator[str]:
    """`servicer` on a free port; its address while the block runs, stopped after."""
    ports: queue.Queue[int] = queue.Queue()
    stop = threading.Event()

    async def serve() -> None:
        server = grpc.aio.server()
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await server.stop(None)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{ports.get(timeout=10)}"
    finally:
        stop.set()
        thread.join(10)
