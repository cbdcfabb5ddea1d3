"""The plaintext health-only port: readiness and liveness for probes, and the probe program.

A worker process whose model is still loading is alive but not ready; the health port answers both
questions and nothing else. The tokenizer service, which loads in a moment, shows the same port
turning ready and going away on stop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.tokenizer.server import SERVICE_NAME
from services.tokenizer.server import start as start_tokenizer
from services.tokenizer.settings import TokenizerSettings
from services.worker.server import start as start_worker
from services.worker.settings import WorkerSettings
from strata import probe
from strata.rpc import LIVENESS
from strata.settings import SettingsError
from strata.v1 import tokenizer_pb2, tokenizer_pb2_grpc

if TYPE_CHECKING:
    from pathlib import Path

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _status(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(reply.status)


def test_the_health_port_serves_readiness_and_liveness_and_nothing_else(tiny_serving_dir: Path) -> None:
    async def main() -> None:
        settings = TokenizerSettings.build(
            {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "models": {"tiny": tiny_serving_dir}}
        )
        server = await start_tokenizer(settings)
        health = server.running.health_address
        assert health and health != server.address
        try:
            for service in ("", SERVICE_NAME, LIVENESS):
                assert await _status(health, service) == SERVING
            assert await asyncio.to_thread(probe.main, [health, "--service", LIVENESS]) == 0
            assert await asyncio.to_thread(probe.main, [health]) == 0
            assert await asyncio.to_thread(probe.main, [health, "--service", "no.such.Service"]) == 1
            async with grpc.aio.insecure_channel(health) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await tokenizer_pb2_grpc.TokenizerServiceStub(channel).GetTokenizerInfo(
                        tokenizer_pb2.GetTokenizerInfoRequest(), timeout=5
                    )
                assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
            # Draining: not ready any more, but alive until the process ends.
            await server.running.set_serving(False)
            assert await _status(health, "") == NOT_SERVING
            assert await _status(health, LIVENESS) == SERVING
            assert await asyncio.to_thread(probe.main, [health]) == 1
        finally:
            await server.stop(grace=0)
        assert await asyncio.to_thread(probe.main, [health, "--service", LIVENESS, "--timeout", "1"]) == 1

    asyncio.run(main())


def test_a_loading_worker_is_alive_but_not_ready(tiny_serving_dir: Path) -> None:
    async def main() -> None:
        settings = WorkerSettings.build(
            {
                "listen": "127.0.0.1:0",
                "health_listen": "127.0.0.1:0",
                "model_name": "tiny",
                "model_path": tiny_serving_dir,
                "device": "cpu",
                "threads": 1,
                # The warm-up generation's step sleeps first, so the worker stays unready a while.
                "engine": {"enable_fault_injection": True, "fault_step_delay_s": 1.0},
            }
        )
        server = await start_worker(settings)
        health = server.running.health_address
        try:
            # start returns before the model is loaded: the probe ports answer at once.
            assert await _status(health, LIVENESS) == SERVING
            assert await _status(health, "") == NOT_SERVING
            await asyncio.wait_for(server.wait_ready(), 60)
            assert await _status(health, "") == SERVING
        finally:
            await server.stop(grace=0)

    asyncio.run(main())


def test_a_bad_health_address_names_the_field() -> None:
    with pytest.raises(SettingsError) as error:
        TokenizerSettings.build({"models": {"m": "."}, "health_listen": "8081"})
    assert "tokenizer.health_listen='8081'" in str(error.value)
    assert "STRATA_TOKENIZER_HEALTH_LISTEN" in str(error.value)
