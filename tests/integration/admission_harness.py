"""In-process stacks for the admission tests: a tokenizer service, workers and gateways on one event
loop in a background thread (a ServerStack), blocking and asyncio clients, and readings of the
gateway's metrics.

Each test gives its route its own model name (the tokenizer serves the tiny model under every name),
so the process-wide Prometheus counters it reads are its own. A route starts from
tests/route_defaults.py's NO_SLO_ROUTE (no TTFT SLO, queue bounds no burst fills), since the
forecast refusal depends on the machine's speed: each test passes the SLO and the queue bounds it
exercises in its route.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY

from gateway.server import start as start_gateway
from gateway.settings import GatewaySettings
from services.tokenizer.server import start as start_tokenizer
from services.tokenizer.settings import TokenizerSettings
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.server import start as start_worker
from services.worker.settings import WorkerSettings
from strata.sampling import SamplingParams
from strata.v1 import common_pb2, gateway_pb2, tokenizer_pb2, tokenizer_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.loop_thread import ServerStack
from tests.route_defaults import NO_SLO_ROUTE

if TYPE_CHECKING:
    from pathlib import Path

    from gateway.server import GatewayServer
    from services.worker.server import WorkerServer

MODELS = (
    "burst",
    "slo",
    "deadline",
    "fair",
    "fifo",
    "worker-fair",
    "worker-fifo",
    "quota",
    "ceiling",
    "shed",
    "replicas",
    "dns",
    "stop",
    "cancel",
    "cached",
    "reserve",
    "reserve-long",
    "no-reserve",
)
WAIT_S = 60.0


def engine_config(max_num_seqs: int) -> dict[str, Any]:
    return {
        "num_blocks": 128,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": 512,
        "enable_fault_injection": True,
    }


class Stack(ServerStack):
    """A tokenizer service for every test model name, plus the workers and gateways tests start."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__()
        self.model_dir = model_dir
        settings = TokenizerSettings.build(
            {"listen": "127.0.0.1:0", "models": dict.fromkeys(MODELS, model_dir)}
        )
        tokenizer = self.loop.run(start_tokenizer(settings))
        self.servers.append(tokenizer)
        self.tokenizer_address = str(tokenizer.address)
        self._engine: LLMEngine | None = None

    def start_worker(
        self,
        model: str,
        *,
        max_requests: int,
        step_delay_s: float = 0.0,
        max_running: int | None = None,
        engine: dict[str, Any] | None = None,
    ) -> WorkerServer:
        """A worker holding `max_requests`, running `max_running` of them at once (all by default), its
        engine settings changed by `engine`."""
        settings = worker_settings(self.model_dir, model, max_requests, max_running, engine)
        server: WorkerServer = self.loop.run(start_worker(settings))
        self.loop.run(server.wait_ready())
        self.servers.append(server)
        set_step_delay(server, step_delay_s)
        return server

    def start_gateway(self, route: dict[str, Any], **extra: Any) -> GatewayServer:
        settings = GatewaySettings.build(
            {
                "listen": "127.0.0.1:0",
                "tokenizer_address": self.tokenizer_address,
                "routes": [{**NO_SLO_ROUTE, **route}],
                "reconnect_backoff_max_s": 0.5,
                **extra,
            }
        )
        gateway: GatewayServer = self.loop.run(start_gateway(settings))
        self.servers.append(gateway)
        assert self.loop.run(gateway.wait_ready(WAIT_S)), f"the gateway did not become ready in {WAIT_S} s"
        return gateway

    def worker_stats(self, worker: WorkerServer) -> worker_pb2.GetWorkerStatsResponse:
        stub = worker_pb2_grpc.WorkerServiceStub(self.channel(worker.address))
        stats: worker_pb2.GetWorkerStatsResponse = stub.GetWorkerStats(
            worker_pb2.GetWorkerStatsRequest(), timeout=10
        )
        return stats

    def prompt_ids(self, model: str, prompt: str) -> list[int]:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel(self.tokenizer_address))
        entry = tokenizer_pb2.TokenizeEntry(model=model, prompt=prompt, max_input_tokens=10_000)
        (result,) = stub.Tokenize(tokenizer_pb2.TokenizeRequest(entries=[entry]), timeout=30).results
        return list(result.token_ids)

    def alone(self, model: str, prompt: str, max_new_tokens: int) -> list[int]:
        """What the engine generates for this prompt alone, greedily."""
        if self._engine is None:
            self._engine = LLMEngine.from_model_dir(
                self.model_dir, EngineConfig.model_validate(engine_config(16))
            )
        engine = self._engine
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        (tokens,) = engine.generate([self.prompt_ids(model, prompt)], params)
        return list(tokens)


def worker_settings(
    model_dir: Path,
    model: str,
    max_requests: int,
    max_running: int | None = None,
    engine: dict[str, Any] | None = None,
) -> WorkerSettings:
    """A tiny worker of `model` on a free port, its engine running `max_running` (default
    `max_requests`) at once, with `engine`'s settings over engine_config's."""
    return WorkerSettings.build(
        {
            "listen": "127.0.0.1:0",
            "model_name": model,
            "model_path": model_dir,
            "device": "cpu",
            "threads": 1,
            "max_requests": max_requests,
            "engine": {**engine_config(max_running or max_requests), **(engine or {})},
        }
    )


def set_step_delay(worker: WorkerServer, seconds: float) -> None:
    """The engine's test-only fault switch: sleep this long before every step."""
    worker.host.engine.engine.faults.set_step_delay(seconds)


def request(
    model: str,
    prompt: str,
    max_new_tokens: int,
    priority: gateway_pb2.Priority.ValueType = gateway_pb2.PRIORITY_UNSPECIFIED,
) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=model,
        prompt=prompt,
        priority=priority,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


def metric(name: str, **labels: str) -> float:
    """A sample of the default registry; 0 when it was never recorded."""
    return REGISTRY.get_sample_value(name, labels) or 0.0
