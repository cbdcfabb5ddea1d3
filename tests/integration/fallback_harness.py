"""The fallback tests' stack: the real tokenizer service, a primary worker, a fallback worker and the
gateway, in-process on ephemeral ports, on one event loop in a background thread (a ServerStack).

It starts, breaks and stops servers and answers what the engines alone would generate; it holds no
tests and asserts nothing about fallback itself (that is tests/integration/test_fallback.py's job).
Both routes start from tests/route_defaults.py's NO_SLO_ROUTE (no TTFT SLO, queue bounds no burst
fills), so no request moves to the fallback, or is refused, for the machine's speed; a test of
fallback under load passes the limits it saturates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.server import GatewayServer
from gateway.server import start as start_gateway
from gateway.settings import GatewaySettings
from services.tokenizer.server import start as start_tokenizer
from services.tokenizer.settings import TokenizerSettings
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.server import WorkerServer
from services.worker.server import start as start_worker
from services.worker.settings import WorkerSettings
from strata.sampling import SamplingParams
from strata.v1 import gateway_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from tests.integration.loop_thread import ServerStack
from tests.polling import wait_for
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from pathlib import Path

PRIMARY, FALLBACK = "tiny", "tiny-small"
OTHER = "tiny-other"
"""A fallback whose tokenizer files differ in bytes (so in fingerprint) though not in meaning."""
ENGINE: dict[str, Any] = {
    "num_blocks": 128,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    "enable_fault_injection": True,
}
PROMPT = "The capital of France"
WAIT_S = 60.0


class Stack(ServerStack):
    """The module's tokenizer and fallback worker; primaries and gateways come and go per test."""

    def __init__(self, primary_dir: Path, fallback_dir: Path, other_dir: Path) -> None:
        super().__init__()
        self.primary_dir = primary_dir
        self.fallback_dir = fallback_dir
        models = {PRIMARY: primary_dir, FALLBACK: fallback_dir, OTHER: other_dir}
        tokenizer = self.loop.run(
            start_tokenizer(TokenizerSettings.build({"listen": "127.0.0.1:0", "models": models}))
        )
        self.servers.append(tokenizer)
        self.tokenizer_address = str(tokenizer.address)
        self.tokenizer = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel(self.tokenizer_address))
        self.fallback = self.start_worker(FALLBACK, fallback_dir)
        self.engines = {
            PRIMARY: LLMEngine.from_model_dir(primary_dir, EngineConfig(**ENGINE)),
            FALLBACK: LLMEngine.from_model_dir(fallback_dir, EngineConfig(**ENGINE)),
        }

    def start_worker(
        self, model: str, model_dir: Path, listen: str = "127.0.0.1:0", **extra: Any
    ) -> WorkerServer:
        settings = WorkerSettings.build(
            {
                "listen": listen,
                "model_name": model,
                "model_path": model_dir,
                "device": "cpu",
                "threads": 1,
                "engine": ENGINE,
                **extra,
            }
        )
        server: WorkerServer = self.loop.run(start_worker(settings))
        self.loop.run(server.wait_ready())
        self.servers.append(server)
        return server

    def start_primary(self, listen: str = "127.0.0.1:0", **extra: Any) -> WorkerServer:
        return self.start_worker(PRIMARY, self.primary_dir, listen, **extra)

    def start_gateway(
        self,
        primary_address: str,
        *,
        fallback: WorkerServer | None = None,
        wait_primary: bool = True,
        **route: Any,
    ) -> tuple[GatewayServer, Any]:
        """A gateway routing PRIMARY to `primary_address`, falling back to `fallback` (the module's)."""
        fallback = fallback or self.fallback
        name = fallback.host.settings.model_name
        settings = GatewaySettings.build(
            {
                "listen": "127.0.0.1:0",
                "tokenizer_address": self.tokenizer_address,
                "routes": [
                    harness_route(PRIMARY, workers=[primary_address], fallback=name, **route),
                    harness_route(name, workers=[fallback.address]),
                ],
            }
        )
        gateway: GatewayServer = self.loop.run(start_gateway(settings))
        self.servers.append(gateway)
        assert self.loop.run(gateway.wait_ready(WAIT_S)), "the gateway did not become ready"
        if wait_primary:  # readiness needs only the fallback: wait for the primary's link too
            wait_for(gateway.router.route(PRIMARY).available, WAIT_S, "the primary's link connected")
        return gateway, gateway_pb2_grpc.GatewayStub(self.channel(gateway.address))

    def crash(self, worker: WorkerServer) -> None:
        """Tear the worker's gRPC server down with no grace: its streams break as in a crash."""
        self.loop.run(worker.running.server.stop(0))

    def prompt_ids(self, prompt: str = PROMPT) -> list[int]:
        entry = tokenizer_pb2.TokenizeEntry(model=PRIMARY, prompt=prompt, max_input_tokens=10_000)
        request = tokenizer_pb2.TokenizeRequest(entries=[entry])
        return list(self.tokenizer.Tokenize(request, timeout=30).results[0].token_ids)

    def text(self, ids: list[int]) -> str:
        entry = tokenizer_pb2.DetokenizeEntry(model=PRIMARY, new_ids=ids, final=True)
        return str(
            self.tokenizer.Detokenize(tokenizer_pb2.DetokenizeRequest(entries=[entry]), timeout=30)
            .results[0]
            .text
        )

    def greedy(self, model: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        """What the model's engine alone generates for this prompt."""
        return self.engines[model].generate([prompt], SamplingParams(max_new_tokens=max_new_tokens))[0]
