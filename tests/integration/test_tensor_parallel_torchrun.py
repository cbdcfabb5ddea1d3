"""Ranks started by a launcher, as on several hosts: torchrun (torch.distributed.run) starts two
`python -m services.worker` processes with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; rank 0
joins the group they describe and serves, rank 1 follows it instead of serving. This is the path a
multi-node group takes (c10d rendezvous), here on one host.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import grpc
import psutil
import pytest
import torch
import yaml

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model.ranks import RankSpec, load_tensor_parallel
from strata.sampling import SamplingParams
from tests.integration.worker_harness import (
    ENGINE,
    REPO,
    WAIT_S,
    async_stub,
    connect,
    submission,
    wait_serving,
)
from tests.polling import announced_address

if TYPE_CHECKING:
    from pathlib import Path

PROMPT = [9, 8, 7, 6]
NEW_TOKENS = 24


def rank_zero(launcher: int) -> psutil.Process:
    """The launcher's child that is rank 0 (RANK in its environment)."""
    ranks = {child.environ()["RANK"]: child for child in psutil.Process(launcher).children()}
    return ranks["0"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def in_process_tokens(model_dir: Path) -> list[int]:
    """The same two ranks' greedy tokens, started by the engine itself (same shards, same order of
    additions, one thread a rank: the same bits as the launcher's ranks)."""
    engine = LLMEngine(
        load_tensor_parallel(RankSpec(model_dir, "cpu", torch.float32, "auto", 2, 60.0, 600.0, 1)),
        EngineConfig(**ENGINE),
    )
    try:
        return engine.generate([PROMPT], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0]
    finally:
        engine.close()


async def generate(address: str, model_dir: Path) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        await wait_serving(channel)
        side = await connect(async_stub(channel), model_dir)
        await side.send(submission("r0", PROMPT, NEW_TOKENS, sampling={"ignore_eos": True}))
        await side.read_until(lambda s: "r0" in s.finals)
        return side.tokens["r0"]


@pytest.mark.slow
def test_torchrun_starts_the_ranks_and_rank_0_serves(tiny_serving_dir: Path, tmp_path: Path) -> None:
    """Two ranks from torchrun serve the tokens the engine's own two ranks give, and a SIGTERM to rank
    0 drains it and stops rank 1: both exit with status 0, so torchrun does too."""
    worker: dict[str, Any] = {
        "model_name": "tiny",
        "model_path": str(tiny_serving_dir),
        "device": "cpu",
        "threads": 1,
        "tensor_parallel_size": 2,
        "engine": ENGINE,
    }
    config = tmp_path / "stack.yaml"
    config.write_text(yaml.safe_dump({"workers": [worker]}))
    announce = tmp_path / "worker.addr"
    environ = {key: value for key, value in os.environ.items() if not key.startswith("STRATA_")}
    # Every rank's and the launcher's log, in a file (a pipe nobody reads could fill and block them),
    # quoted when the group fails, since either rank's failure makes torchrun stop the other.
    log = tmp_path / "ranks.log"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    worker_command = ["-m", "services.worker", "--config", str(config), "--index", "0"]
    with log.open("w") as sink:
        process = subprocess.Popen(
            [*launcher, *rendezvous, *worker_command, "--announce-file", str(announce)],
            cwd=REPO,
            env=environ,
            stdout=subprocess.DEVNULL,
            stderr=sink,
        )
    try:
        try:
            address = announced_address(process, announce, WAIT_S)
            served = asyncio.run(generate(address, tiny_serving_dir))
            rank_zero(process.pid).send_signal(signal.SIGTERM)
            assert process.wait(timeout=WAIT_S) == 0
        except (AssertionError, grpc.RpcError, TimeoutError, subprocess.TimeoutExpired) as error:
            failure = f"the torchrun group failed: {error!r}; its log:\n{log.read_text()}"
            raise AssertionError(failure) from error
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    assert served == in_process_tokens(tiny_serving_dir)
