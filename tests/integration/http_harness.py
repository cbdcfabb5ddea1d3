"""The HTTP API tests' stack: the real tokenizer service, a real worker and the gateway with its HTTP API
on ephemeral ports, on one event loop in a background thread (a ServerStack), plus what the tests read
of them.

The worker's engine sleeps a little before each step (fault injection, test mode only) so that a
long generation lasts long enough for a client to walk away from it; it holds few credits so that
further requests wait in the gateway's queue. Two API keys: the default tenant's, and a tenant
limited to one request at a time (for 429s whose retry hint is known: 1 s). The route carries
tests/route_defaults.py's NO_SLO_ROUTE (no TTFT SLO, queue bounds no burst fills): a request that
waits for a credit queues, however slow the machine, instead of being refused on its forecast.
"""

from __future__ import annotations

import json
import subprocess
from typing import TYPE_CHECKING, Any

from gateway.server import start as start_gateway
from gateway.settings import GatewaySettings
from services.tokenizer.server import start as start_tokenizer
from services.tokenizer.settings import TokenizerSettings
from services.worker.server import start as start_worker
from services.worker.settings import WorkerSettings
from strata.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.loop_thread import ServerStack
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from pathlib import Path

    from strata.tracing import Tracing

KEY = "http-test-key"
TIGHT_KEY = "http-tight-key"
"""The key of tenant `tight`: one request running at a time."""
MAX_BODY = 64 * 1024
STEP_DELAY_S = 0.004
CREDITS = 3
MODEL = "tiny"


class HttpStack(ServerStack):
    """The three services serving `model_dir` as `model`, the gateway's HTTP API on a free port; the
    worker sleeps `step_delay_s` before each engine step. `engine` adds to the worker's engine settings,
    `worker` to the worker's others, `gateway` to the gateway's."""

    def __init__(
        self,
        model_dir: Path,
        model: str = MODEL,
        tracing: Tracing | None = None,
        step_delay_s: float = STEP_DELAY_S,
        engine: dict[str, Any] | None = None,
        worker: dict[str, Any] | None = None,
        **gateway: Any,
    ) -> None:
        super().__init__()
        self.worker: Any = None
        """The running worker server (its engine host under .host)."""
        try:
            self.gateway, self.worker_address = self._start(
                model_dir, model, tracing, step_delay_s, engine or {}, worker or {}, gateway
            )
        except BaseException:
            self.close()
            raise
        self.base_url = f"http://{self.gateway.http.address}/v1"
        """http://host:port/v1, as the openai SDK takes it."""
        self.gateway_address: str = self.gateway.address

    def _start(
        self,
        model_dir: Path,
        model: str,
        tracing: Tracing | None,
        step_delay_s: float,
        engine: dict[str, Any],
        worker_extra: dict[str, Any],
        gateway: dict[str, Any],
    ) -> tuple[Any, str]:
        """The running gateway and the worker's address."""
        tokenizer = self.loop.run(
            start_tokenizer(TokenizerSettings.build({"listen": "127.0.0.1:0", "models": {model: model_dir}}))
        )
        self.servers.append(tokenizer)
        worker_settings = {
            "listen": "127.0.0.1:0",
            "model_name": model,
            "model_path": model_dir,
            "device": "cpu",
            "threads": 1,
            "max_requests": CREDITS,
            "engine": {
                "num_blocks": 128,
                "max_num_seqs": 8,
                "enable_fault_injection": True,
                "fault_step_delay_s": step_delay_s,
                **engine,
            },
            **worker_extra,
        }
        worker = self.loop.run(start_worker(WorkerSettings.build(worker_settings)))
        self.servers.append(worker)
        self.worker = worker
        self.loop.run(worker.wait_ready())
        settings = {
            "listen": "127.0.0.1:0",
            "http_listen": "127.0.0.1:0",
            "tokenizer_address": tokenizer.address,
            "routes": [harness_route(model, workers=[worker.address])],
            "max_message_bytes": MAX_BODY,
            "api_keys": [KEY],
            "tenants": [{"name": "tight", "api_keys": [TIGHT_KEY], "max_concurrent_requests": 1}],
            **gateway,
        }
        running = self.loop.run(start_gateway(GatewaySettings.build(settings), tracing=tracing))
        self.servers.append(running)
        assert self.loop.run(running.wait_ready(60)), "the gateway did not become ready in 60 s"
        assert running.http is not None
        return running, str(worker.address)

    @property
    def origin(self) -> str:
        return self.base_url.removesuffix("/v1")

    def worker_stats(self) -> worker_pb2.GetWorkerStatsResponse:
        stub = worker_pb2_grpc.WorkerServiceStub(self.channel(self.worker_address))
        stats: worker_pb2.GetWorkerStatsResponse = stub.GetWorkerStats(
            worker_pb2.GetWorkerStatsRequest(), timeout=10
        )
        return stats

    def queued(self) -> int:
        stub = gateway_pb2_grpc.GatewayStub(self.channel(self.gateway_address))
        reply = stub.ListModels(
            gateway_pb2.ListModelsRequest(), metadata=[("authorization", f"Bearer {KEY}")], timeout=10
        )
        return sum(model.queued_requests for model in reply.models)

    def idle(self) -> bool:
        stats = self.worker_stats()
        return stats.used_kv_blocks == 0 and stats.open_requests == 0


def curl_events(url: str, body: dict[str, Any], headers: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """POST `body` with curl (no buffering) and read the raw Server-Sent Events framing: each event a
    block of exactly an `event:` line and a `data:` line, blocks apart by a blank line; the (name,
    data) pairs. curl is what an operator debugging a stream types."""
    command = [
        "curl",
        "-sSN",
        "--max-time",
        "60",
        "-H",
        "content-type: application/json",
        "--data",
        json.dumps(body),
    ]
    for name, value in headers.items():
        command += ["-H", f"{name}: {value}"]
    done = subprocess.run([*command, url], capture_output=True, text=True, timeout=90, check=True)
    events = []
    for block in done.stdout.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.strip("\n").split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events
