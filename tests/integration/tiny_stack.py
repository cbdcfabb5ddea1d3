"""One tiny stack in-process for a test's own event loop: the real tokenizer service, one worker (or
several replicas on one route) and the gateway on 127.0.0.1:0, started in order and stopped gateway
first however the test ends. The route starts from tests/route_defaults.py's NO_SLO_ROUTE (no TTFT
SLO, queue bounds no burst fills), so no request is refused for the machine's speed; `route` adds
a test's own admission settings.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.server import start as start_gateway
from gateway.settings import GatewaySettings
from services.tokenizer.server import start as start_tokenizer
from services.tokenizer.settings import TokenizerSettings
from services.worker.server import start as start_worker
from services.worker.settings import WorkerSettings
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from gateway.server import GatewayServer
    from services.tokenizer.server import TokenizerServer
    from services.worker.server import WorkerServer
    from strata.tracing import Tracing

READY_S = 60.0


@dataclass
class TinyStack:
    tokenizer: TokenizerServer
    worker: WorkerServer
    gateway: GatewayServer
    workers: tuple[WorkerServer, ...] = ()
    """Every replica of the route (worker is the first)."""


@contextlib.asynccontextmanager
async def tiny_stack(
    model_dir: Path,
    *,
    worker: dict[str, Any] | None = None,
    gateway: dict[str, Any] | None = None,
    gateway_tracing: Tracing | None = None,
    replicas: int = 1,
    route: dict[str, Any] | None = None,
) -> AsyncIterator[TinyStack]:
    """The three services serving `model_dir` as model "tiny" (with `replicas` workers on its route);
    `worker`, `gateway` and `route` (the route's own) add settings."""
    async with contextlib.AsyncExitStack() as stack:
        tokenizer = await start_tokenizer(
            TokenizerSettings.build({"listen": "127.0.0.1:0", "models": {"tiny": model_dir}})
        )
        stack.push_async_callback(tokenizer.stop, 0)
        worker_settings = {
            "listen": "127.0.0.1:0",
            "model_name": "tiny",
            "model_path": model_dir,
            "device": "cpu",
            "threads": 1,
            **(worker or {}),
        }
        workers = []
        for _ in range(replicas):
            running_worker = await start_worker(WorkerSettings.build(worker_settings))
            stack.push_async_callback(running_worker.stop, 0)
            await running_worker.wait_ready()
            workers.append(running_worker)
        gateway_settings = {
            "listen": "127.0.0.1:0",
            "tokenizer_address": tokenizer.address,
            "routes": [harness_route("tiny", workers=[w.address for w in workers], **(route or {}))],
            **(gateway or {}),
        }
        running_gateway = await start_gateway(
            GatewaySettings.build(gateway_settings), tracing=gateway_tracing
        )
        stack.push_async_callback(running_gateway.stop, 0)
        assert await running_gateway.wait_ready(READY_S), "the tiny stack's gateway never became ready"
        yield TinyStack(tokenizer, workers[0], running_gateway, tuple(workers))
