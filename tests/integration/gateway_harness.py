"""The gateway tests' in-process stack: a real tokenizer service, workers and gateways on one event
loop in a background thread (a ServerStack), with blocking clients, plus the small request helpers
the tests share.

Its gateways' routes carry tests/route_defaults.py's NO_SLO_ROUTE: no TTFT SLO and queue bounds no
test's burst fills, so a correctness test is never refused for the machine's speed; a test about
admission passes its own `ttft_slo_ms` and queue bounds in `route`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.server import start as start_gateway
from gateway.settings import GatewaySettings
from services.tokenizer.server import start as start_tokenizer
from services.tokenizer.settings import TokenizerSettings
from services.worker.server import start as start_worker
from services.worker.settings import WorkerSettings
from strata.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2_grpc,
)
from tests.integration.loop_thread import ServerStack
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from pathlib import Path

ENGINE = {"num_blocks": 128, "max_num_seqs": 32, "max_num_batched_tokens": 256}
MAX_MESSAGE_BYTES = 64 * 1024
CONTEXT = 256  # the tiny model's max_position_embeddings
RETRY_AFTER_S = 0.75


class Stack(ServerStack):
    """Tokenizer services, workers and gateways of the tiny model, started as a test asks."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__()
        self.model_dir = model_dir

    def start_tokenizer(self) -> str:
        settings = TokenizerSettings.build({"listen": "127.0.0.1:0", "models": {"tiny": self.model_dir}})
        server = self.loop.run(start_tokenizer(settings))
        self.servers.append(server)
        return str(server.address)

    def start_worker(self, model_dir: Path, **extra: Any) -> str:
        settings = WorkerSettings.build(
            {
                "listen": "127.0.0.1:0",
                "model_name": "tiny",
                "model_path": model_dir,
                "device": "cpu",
                "threads": 1,
                "engine": ENGINE,
                **extra,
            }
        )
        server = self.loop.run(start_worker(settings))
        self.loop.run(server.wait_ready())
        self.servers.append(server)
        return str(server.address)

    def start_gateway(
        self, tokenizer: str, worker: str, *, wait: bool = True, route: dict[str, Any] | None = None
    ) -> Any:
        settings = GatewaySettings.build(
            {
                "listen": "127.0.0.1:0",
                "tokenizer_address": tokenizer,
                "routes": [harness_route("tiny", workers=[worker], **(route or {}))],
                "max_message_bytes": MAX_MESSAGE_BYTES,
                "reconnect_backoff_max_s": 0.5,
                "overload_retry_after_s": RETRY_AFTER_S,
            }
        )
        gateway = self.loop.run(start_gateway(settings))
        self.servers.append(gateway)
        if wait:
            assert self.loop.run(gateway.wait_ready(60)), "the gateway did not become ready in 60 s"
        return gateway


class Env:
    """The module's stack and its clients."""

    def __init__(self, stack: Stack, gateway: Any, tokenizer: str, worker: str) -> None:
        self.stack = stack
        self.gateway_server = gateway
        self.tokenizer_address = tokenizer
        self.gateway = gateway_pb2_grpc.GatewayStub(stack.channel(gateway.address))
        self.tokenizer = tokenizer_pb2_grpc.TokenizerServiceStub(stack.channel(tokenizer))
        self.worker = worker_pb2_grpc.WorkerServiceStub(stack.channel(worker))
        self.gateway_channel = stack.channels[0]

    def prompt_ids(self, prompt: str) -> list[int]:
        entry = tokenizer_pb2.TokenizeEntry(model="tiny", prompt=prompt, max_input_tokens=10_000)
        (result,) = self.tokenizer.Tokenize(
            tokenizer_pb2.TokenizeRequest(entries=[entry]), timeout=30
        ).results
        return list(result.token_ids)


def make_request(prompt: str = "Hello world", **sampling: Any) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(**sampling))
