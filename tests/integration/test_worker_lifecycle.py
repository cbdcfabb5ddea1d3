"""The worker's lifecycle: readiness only after load and warm-up, refusal when either fails, the
drain on stop, the command line, and the real process answering SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.worker.model.config import ModelLoadError
from services.worker.server import SERVICE_NAME, main, serve, start
from services.worker.settings import WorkerSettings
from strata.fingerprint import tokenizer_fingerprint
from strata.sampling import InvalidRequestError
from strata.tracing import Tracing
from strata.v1 import common_pb2, worker_pb2
from tests.integration.worker_harness import (
    ENGINE,
    UNAVAILABLE,
    WAIT_S,
    GatewaySide,
    async_stub,
    connect,
    expected_tokens,
    slow_steps,
    submission,
    wait_serving,
    worker_process,
    worker_settings,
)
from tests.polling import announced_address, wait_for_async

REPO = Path(__file__).resolve().parents[2]


def test_health_turns_serving_after_load_and_warm_up(tiny_serving_dir: Path) -> None:
    async def main() -> None:
        server = await start(worker_settings(tiny_serving_dir))
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                stub = async_stub(channel)
                watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                status = (await asyncio.wait_for(watch.read(), WAIT_S)).status
                while status != health_pb2.HealthCheckResponse.SERVING:
                    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
                    status = (await asyncio.wait_for(watch.read(), WAIT_S)).status
                watch.cancel()
                # SERVING came after a real generation: the warm-up ran an engine step.
                stats = await stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest())
                assert stats.steps >= 1 and stats.total_kv_blocks == 64
                info = await stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest())
                assert (info.model, info.max_requests, info.device, info.dtype) == (
                    "tiny",
                    16,
                    "cpu",
                    "float32",
                )
                assert info.tokenizer_fingerprint == tokenizer_fingerprint(tiny_serving_dir)
                assert (info.max_model_len, list(info.eos_token_ids)) == (256, [])
                first = await GatewaySide(stub).hello("tiny", info.tokenizer_fingerprint)
                assert first.hello.info == info and first.credits.requests == 16
        finally:
            await server.stop(grace=0)

    asyncio.run(main())


@pytest.mark.real_model
def test_health_and_connect_answer_during_a_load(real_model_dir: Path) -> None:
    """The real model takes seconds to load: long enough to be asked while it does."""

    async def main() -> None:
        settings = WorkerSettings.build(
            {"model_name": "smol", "model_path": str(real_model_dir), "device": "cpu", "engine": ENGINE}
        )
        server = await start(settings)
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                status = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await GatewaySide(async_stub(channel)).hello(
                        "smol", tokenizer_fingerprint(real_model_dir)
                    )
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "loading" in (refused.value.details() or "")
                info = await async_stub(channel).GetWorkerInfo(worker_pb2.GetWorkerInfoRequest())
                assert (info.model, info.max_requests) == ("smol", 16)
                assert not server.host.ready.is_set()
                await asyncio.wait_for(server.wait_ready(), WAIT_S)
                status = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                assert status.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(grace=0)

    asyncio.run(main())


@pytest.mark.parametrize("broken", ["weights", "warm_up"])
def test_a_worker_that_cannot_load_or_warm_up_never_serves(
    tiny_serving_dir: Path, tmp_path: Path, broken: str
) -> None:
    model_dir = tiny_serving_dir
    extra: dict[str, Any] = {}
    error: type[Exception] = ModelLoadError
    if broken == "weights":
        model_dir = tmp_path / "no-weights"
        model_dir.mkdir()
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (model_dir / name).write_bytes((tiny_serving_dir / name).read_bytes())
    else:
        # The model loads, but a one-token context leaves no room for a generation.
        extra = {"engine": {"num_blocks": 1, "block_size": 1}}
        error = InvalidRequestError

    async def main() -> None:
        server = await start(worker_settings(model_dir, **extra))
        try:
            with pytest.raises(error):
                await asyncio.wait_for(server.wait_ready(), WAIT_S)
            async with grpc.aio.insecure_channel(server.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                status = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await connect(async_stub(channel), model_dir)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(grace=0)
        # The process entry point exits non-zero instead of serving NOT_SERVING forever.
        serving = serve(worker_settings(model_dir, **extra), None, Tracing.off())
        assert await asyncio.wait_for(serving, WAIT_S) == 1

    asyncio.run(main())


def test_stop_drains_running_requests_and_refuses_new_ones(tiny_serving_dir: Path) -> None:
    async def main() -> tuple[GatewaySide, GatewaySide]:
        server = await start(worker_settings(tiny_serving_dir))
        await asyncio.wait_for(server.wait_ready(), WAIT_S)
        slow_steps(server, 0.01)
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = async_stub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            drained = await connect(stub, tiny_serving_dir)
            await drained.send(submission("runs", [3, 4, 5], 60))
            await drained.read_until(lambda s: "runs" in s.tokens)
            stopping = asyncio.create_task(server.stop(grace=WAIT_S))
            # The stop runs as its own task: its readiness flips once that task has begun.
            await wait_for_async(
                lambda: health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)),
                WAIT_S,
                "the stopping worker's health NOT_SERVING",
                until=lambda reply: reply.status == health_pb2.HealthCheckResponse.NOT_SERVING,
            )
            await drained.send(submission("new", [3, 4], 4))
            await drained.read_until(lambda s: s.ended)
            assert await drained.call.code() == grpc.StatusCode.OK
            await asyncio.wait_for(stopping, WAIT_S)
        # A drain that runs out of time aborts what is left and still ends the streams cleanly.
        server = await start(worker_settings(tiny_serving_dir))
        await asyncio.wait_for(server.wait_ready(), WAIT_S)
        slow_steps(server, 0.02)
        async with grpc.aio.insecure_channel(server.address) as channel:
            cut = await connect(async_stub(channel), tiny_serving_dir)
            await cut.send(submission("endless", [3, 4, 5], 200))
            await cut.read_until(lambda s: "endless" in s.tokens)
            await asyncio.wait_for(server.stop(grace=0.2), WAIT_S)
            await cut.read_until(lambda s: s.ended)
        return drained, cut

    drained, cut = asyncio.run(main())
    assert len(drained.tokens["runs"]) == 60
    assert drained.finals["runs"].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert drained.rejections["new"].code == UNAVAILABLE
    # The client never cancelled: a drain that gave up on it reports the serving side's failure.
    assert cut.finals["endless"].finish_reason == common_pb2.FINISH_REASON_ERROR
    assert len(cut.tokens["endless"]) < 200


def test_bad_settings_exit_with_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        yaml.safe_dump({"workers": [{"model_name": "tiny", "model_path": "m", "drain_timeout_s": -1}]})
    )
    assert main(["--config", str(config)]) == 2
    assert "drain_timeout_s" in capsys.readouterr().err
    assert main(["--config", str(config), "--index", "3"]) == 2
    assert "index 3" in capsys.readouterr().err


@pytest.mark.slow
def test_the_worker_process_serves_and_drains_on_sigterm(tiny_serving_dir: Path, tmp_path: Path) -> None:
    worker = {"model_name": "tiny", "model_path": str(tiny_serving_dir), "device": "cpu", "engine": ENGINE}
    process, announce = worker_process(worker, tmp_path)
    want = expected_tokens(tiny_serving_dir, [9, 8, 7], 200)

    async def drive(address: str) -> tuple[list[int], GatewaySide]:
        async with grpc.aio.insecure_channel(address) as channel:
            statuses = await wait_serving(channel)
            side = await connect(async_stub(channel), tiny_serving_dir)
            await side.send(*(submission(f"r{i}", [9, 8, 7], 200) for i in range(4)))
            await side.read_until(lambda s: len(s.tokens.get("r0", [])) >= 1)
            process.send_signal(signal.SIGTERM)
            await side.read_until(lambda s: s.ended)
            assert await side.call.code() == grpc.StatusCode.OK
            return statuses, side

    try:
        statuses, side = asyncio.run(drive(announced_address(process, announce, WAIT_S)))
        assert process.wait(timeout=WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # NOT_SERVING while loading (when the watch began early enough to see it), then SERVING.
    assert set(statuses[:-1]) <= {health_pb2.HealthCheckResponse.NOT_SERVING}
    assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING
    for i in range(4):
        assert side.tokens[f"r{i}"] == want
        assert side.finals[f"r{i}"].finish_reason == common_pb2.FINISH_REASON_LENGTH
