"""A tensor-parallel worker whose other rank dies or hangs: the real worker process (`python -m
services.worker`, two ranks over gloo) serving a stream over gRPC, rank 1 killed with SIGKILL or
stopped with SIGSTOP mid-stream. The stream must fail, health must turn NOT_SERVING and the process
must exit with status 1 within the collective timeout, so whatever supervises it restarts the group;
never a worker that still says SERVING.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.worker.server import SERVICE_NAME
from strata.v1 import common_pb2
from tests.integration.worker_harness import (
    ENGINE,
    WAIT_S,
    async_stub,
    connect,
    submission,
    wait_serving,
    worker_process,
)
from tests.polling import announced_address, wait_for

TIMEOUT_S = 5.0
"""tensor_parallel_timeout_s of these workers: a hung rank is given up after this."""


def two_rank_worker(model_dir: Path, engine: dict[str, Any]) -> dict[str, Any]:
    """The `workers:` entry of these tests: the tiny model over two one-thread ranks, TIMEOUT_S."""
    return {
        "model_name": "tiny",
        "model_path": str(model_dir),
        "device": "cpu",
        "threads": 1,
        "tensor_parallel_size": 2,
        "tensor_parallel_timeout_s": TIMEOUT_S,
        "engine": engine,
    }


def rank_processes(pid: int) -> list[int]:
    """The processes a worker started (its other ranks), from every thread's children in /proc."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        found.extend(int(child) for child in children)
    return found


async def drive(
    address: str, model_dir: Path, rank_pid: int, sig: signal.Signals, idle: bool
) -> tuple[Any, list[int], float]:
    """Start a long stream (unless `idle`), signal rank 1 once tokens flow; (how the stream ended,
    the health statuses watched from before the signal until the server went away, seconds from the
    signal to the stream's end)."""
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert (await asyncio.wait_for(watch.read(), WAIT_S)).status == health_pb2.HealthCheckResponse.SERVING
        if idle:
            os.kill(rank_pid, sig)
            return None, await statuses_until_gone(watch), 0.0
        side = await connect(async_stub(channel), model_dir)
        await side.send(submission("r0", [9, 8, 7], 200))
        await side.read_until(lambda s: len(s.tokens.get("r0", [])) >= 2)
        os.kill(rank_pid, sig)
        signalled = time.monotonic()
        try:
            await side.read_until(lambda s: s.ended or "r0" in s.finals, timeout=WAIT_S)
            ending: Any = side.finals.get("r0")
        except grpc.aio.AioRpcError as error:
            ending = error.code()
        ended = time.monotonic() - signalled
        return ending, await statuses_until_gone(watch), ended


async def statuses_until_gone(watch: Any) -> list[int]:
    """The health statuses a watch reports until the worker stops answering it."""
    statuses: list[int] = []
    try:
        while (message := await asyncio.wait_for(watch.read(), WAIT_S)) is not grpc.aio.EOF:
            statuses.append(message.status)
    except grpc.aio.AioRpcError:
        return statuses  # the worker stopped serving health: it is exiting
    return statuses


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "idle"),
    [(signal.SIGKILL, False), (signal.SIGSTOP, False), (signal.SIGKILL, True)],
    ids=["killed", "hung", "killed-while-idle"],
)
def test_a_lost_rank_ends_the_worker(
    sig: signal.Signals, idle: bool, tiny_serving_dir: Path, tmp_path: Path
) -> None:
    """Rank 1 killed or hung mid-stream, or killed while nothing runs: the stream ends with an error,
    health turns NOT_SERVING, the worker exits with status 1 within a few collective timeouts (the
    heartbeat finds a rank that died while idle), and no rank is left behind."""
    # Slow steps keep the stream running while the rank is signalled.
    worker = two_rank_worker(tiny_serving_dir, {**ENGINE, "fault_step_delay_s": 0.02})
    process, announce = worker_process(worker, tmp_path)
    ranks: list[int] = []
    try:
        address = announced_address(process, announce, WAIT_S)
        ranks = wait_for(lambda: rank_processes(process.pid), WAIT_S, "the worker's rank 1")
        assert len(ranks) == 1
        ending, statuses, ended = asyncio.run(drive(address, tiny_serving_dir, ranks[0], sig, idle))
        assert process.wait(timeout=5 * TIMEOUT_S) == 1
    finally:
        for pid in ranks:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
        process.wait()
    assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING]
    if not idle:
        assert ending.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert ended < 5 * TIMEOUT_S
    # The worker reaped its rank: a killed one is gone; a stopped one was killed on the way out.
    assert (
        not Path(f"/proc/{ranks[0]}").exists() or "Z" in Path(f"/proc/{ranks[0]}/stat").read_text().split()[2]
    )


RANK_START_DELAY_S = 2 * TIMEOUT_S
"""How much later than rank 0 the slow-starting rank 1 joins: well past the step timeout."""

SLOW_RANK = f"""
import os, time
if os.environ.get("RANK") == "1":
    time.sleep({RANK_START_DELAY_S})
"""


@pytest.mark.slow
def test_a_rank_that_joins_later_than_the_step_timeout_still_forms_the_group(
    tiny_serving_dir: Path, tmp_path: Path
) -> None:
    """Rank 1 starting twice the step timeout after rank 0 (as on a loaded machine, where its Python
    and torch imports alone take seconds) is waited for within the start bound, not the step bound: the
    worker turns SERVING and answers, and SIGTERM ends both ranks with status 0. The delay is a
    sitecustomize on rank 1's path that sleeps when RANK is 1 (rank 0 has no RANK of its own)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_RANK)
    process, announce = worker_process(
        two_rank_worker(tiny_serving_dir, ENGINE), tmp_path, env={"PYTHONPATH": str(hook)}
    )

    async def serve_one(address: str) -> list[int]:
        async with grpc.aio.insecure_channel(address) as channel:
            await wait_serving(channel)
            side = await connect(async_stub(channel), tiny_serving_dir)
            await side.send(submission("r0", [9, 8, 7], 4))
            await side.read_until(lambda s: "r0" in s.finals, timeout=WAIT_S)
            return side.tokens["r0"]

    try:
        address = announced_address(process, announce, WAIT_S)
        started = time.monotonic()
        tokens = asyncio.run(serve_one(address))
        waited = time.monotonic() - started
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0, process.stderr.read() if process.stderr else ""
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    assert len(tokens) == 4
    assert waited >= RANK_START_DELAY_S  # rank 1 really came late: the hook ran
