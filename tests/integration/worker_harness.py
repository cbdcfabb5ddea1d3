"""A gateway's side of the worker, for the worker's integration tests: settings, a running in-process
worker, and a Connect stream client that keeps everything it receives per request.

Requests that must stay running slow each engine step with the engine's test-only fault injection.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.server import SERVICE_NAME, WorkerServer, start
from services.worker.settings import WorkerSettings
from strata.fingerprint import tokenizer_fingerprint
from strata.sampling import SamplingParams
from strata.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.polling import wait_for_async

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

ENGINE: dict[str, Any] = {"num_blocks": 64, "max_num_seqs": 8, "enable_fault_injection": True}
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
# Generous: a tiny-model step takes milliseconds, but the machine is shared.
WAIT_S = 60.0


REPO = Path(__file__).resolve().parents[2]


def worker_process(
    worker: dict[str, Any], directory: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], Path]:
    """`python -m services.worker` as its own process, serving `worker` (one entry of `workers:`)
    from a config written in `directory`, with no STRATA_ variable of this process and `env` added;
    its stderr piped as text. Returns the process and the file it announces its address in."""
    config = directory / "stack.yaml"
    config.write_text(yaml.safe_dump({"workers": [worker]}))
    announce = directory / "worker.addr"
    environ = {key: value for key, value in os.environ.items() if not key.startswith("STRATA_")}
    command = [sys.executable, "-m", "services.worker", "--config", str(config), "--index", "0"]
    process = subprocess.Popen(
        [*command, "--announce-file", str(announce)],
        cwd=REPO,
        env={**environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return process, announce


def worker_settings(model_dir: Path, **extra: Any) -> WorkerSettings:
    return WorkerSettings.build(
        {
            "model_name": "tiny",
            "model_path": str(model_dir),
            "listen": "127.0.0.1:0",
            "device": "cpu",
            "engine": ENGINE,
            **extra,
        }
    )


def expected_tokens(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """What the engine generates for this prompt alone, greedily."""
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(**ENGINE))
    return engine.generate([prompt], SamplingParams(max_new_tokens=max_new_tokens))[0]


def submission(
    request_id: str, prompt: list[int], max_new_tokens: int, **extra: Any
) -> worker_pb2.Submission:
    sampling = extra.pop("sampling", {})
    return worker_pb2.Submission(
        request_id=request_id,
        prompt_ids=prompt,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, **sampling),
        **extra,
    )


def async_stub(channel: grpc.aio.Channel) -> worker_pb2_grpc.WorkerServiceAsyncStub:
    return worker_pb2_grpc.WorkerServiceStub(channel)  # type: ignore[return-value]


@asynccontextmanager
async def running_worker(
    model_dir: Path, **extra: Any
) -> AsyncIterator[tuple[WorkerServer, worker_pb2_grpc.WorkerServiceAsyncStub]]:
    server = await start(worker_settings(model_dir, **extra))
    try:
        await asyncio.wait_for(server.wait_ready(), WAIT_S)
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield server, async_stub(channel)
    finally:
        await server.stop(grace=0)


def slow_steps(server: WorkerServer, seconds: float) -> None:
    server.host.engine.engine.faults.set_step_delay(seconds)


class GatewaySide:
    """One Connect stream as a gateway drives it: everything received is kept per request."""

    def __init__(
        self, stub: worker_pb2_grpc.WorkerServiceAsyncStub, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.call = stub.Connect(metadata=metadata)
        self.tokens: dict[str, list[int]] = {}
        self.finals: dict[str, worker_pb2.TokenUpdate] = {}
        self.firsts: dict[str, worker_pb2.TokenUpdate] = {}
        self.rejections: dict[str, worker_pb2.Rejection] = {}
        self.credits: list[int] = []
        self.messages: list[worker_pb2.ConnectResponse] = []
        """Every message after the hello, in order."""
        self.ended = False

    async def hello(self, model: str, fingerprint: str) -> worker_pb2.ConnectResponse:
        hello = worker_pb2.ConnectHello(model=model, tokenizer_fingerprint=fingerprint, client_name="test")
        await self.call.write(worker_pb2.ConnectRequest(hello=hello))
        first = await asyncio.wait_for(self.call.read(), WAIT_S)
        assert isinstance(first, worker_pb2.ConnectResponse)
        self._apply(first)
        self.messages.clear()
        return first

    async def send(self, *submissions: worker_pb2.Submission, cancel: tuple[str, ...] = ()) -> None:
        await self.call.write(worker_pb2.ConnectRequest(submissions=submissions, cancellations=cancel))

    def _apply(self, message: worker_pb2.ConnectResponse) -> None:
        self.messages.append(message)
        for update in message.updates:
            self.tokens.setdefault(update.request_id, []).extend(update.token_ids)
            self.firsts.setdefault(update.request_id, update)
            if update.finished:
                self.finals[update.request_id] = update
        for rejection in message.rejections:
            self.rejections[rejection.request_id] = rejection
        if message.HasField("credits"):
            self.credits.append(message.credits.requests)

    async def read_until(self, done: Any, timeout: float = WAIT_S) -> None:
        """Read messages until done(self) holds; fail after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not done(self):
            assert not self.ended, "the stream ended before the condition held"
            remaining = deadline - time.monotonic()
            assert remaining > 0, "condition not met in time"
            message = await asyncio.wait_for(self.call.read(), remaining)
            if message is grpc.aio.EOF:
                self.ended = True
            else:
                self._apply(message)


async def wait_serving(channel: grpc.aio.Channel) -> list[int]:
    """Watch the worker's health until it says SERVING; the statuses seen on the way."""
    health = health_pb2_grpc.HealthStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    statuses = [(await asyncio.wait_for(watch.read(), WAIT_S)).status]
    while statuses[-1] != health_pb2.HealthCheckResponse.SERVING:
        statuses.append((await asyncio.wait_for(watch.read(), WAIT_S)).status)
    watch.cancel()
    return statuses


async def connect(
    stub: worker_pb2_grpc.WorkerServiceAsyncStub, model_dir: Path, metadata: tuple[tuple[str, str], ...] = ()
) -> GatewaySide:
    side = GatewaySide(stub, metadata)
    await side.hello("tiny", tokenizer_fingerprint(model_dir))
    return side


async def wait_idle(stub: worker_pb2_grpc.WorkerServiceAsyncStub) -> worker_pb2.GetWorkerStatsResponse:
    """Poll stats until nothing runs and no KV block is used."""
    stats: worker_pb2.GetWorkerStatsResponse = await wait_for_async(
        lambda: stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest()),
        WAIT_S,
        "the worker let go of all its work",
        until=lambda now: now.running == now.waiting == now.used_kv_blocks == now.open_requests == 0,
    )
    return stats
