"""What the reliability scenarios share: a one-model stack config, probes of health and worker state,
requests, and the resident memory of a process (bounded waits: tests/polling.py).

Every stack here is real processes on loopback (strata.cli.launcher.start_stack, or a service started
alone with `python -m ... --config --announce-file`), serving the tiny model of tests/conftest.py.
Every port is one the OS chose when the service bound port 0, read back from its announce file: a
port picked here and bound later by a child could be taken in between.
Every wait is bounded in time. This module must not assert a scenario's outcome; the tests do.
A config's route starts from tests/route_defaults.py's NO_SLO_ROUTE (no TTFT SLO, queue bounds no
burst fills): a scenario about admission or overload passes the limits it exercises in `route`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import grpc
import psutil
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from strata.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from pathlib import Path

MODEL = "tiny"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def write_config(
    path: Path,
    model_dir: Path,
    *,
    engine: dict[str, Any],
    worker: dict[str, Any] | None = None,
    route: dict[str, Any] | None = None,
    gateway: dict[str, Any] | None = None,
    tokenizer: dict[str, Any] | None = None,
) -> Path:
    """A stack config: one tokenizer, one worker of `model_dir` on the CPU, one gateway, one route."""
    config = {
        "telemetry": {"log_format": "text"},
        "tokenizer": {"listen": "127.0.0.1:0", "models": {MODEL: str(model_dir)}, **(tokenizer or {})},
        "workers": [
            {
                "listen": "127.0.0.1:0",
                "model_name": MODEL,
                "model_path": str(model_dir),
                "device": "cpu",
                "threads": 1,
                "engine": engine,
                **(worker or {}),
            }
        ],
        "gateway": {
            "listen": "127.0.0.1:0",
            "default_model": MODEL,
            "reconnect_backoff_max_s": 0.5,
            "routes": [harness_route(MODEL, **(route or {}))],
            **(gateway or {}),
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def request(
    prompt: str, max_new_tokens: int, *, ignore_eos: bool = True, model: str = MODEL
) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=model,
        prompt=prompt,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos),
    )


def health(address: str, service: str = "", timeout: float = 1.0) -> int | None:
    """The health status `address` reports for `service`; None when it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return None
    return int(reply.status)


def worker_stats(address: str) -> worker_pb2.GetWorkerStatsResponse:
    with grpc.insecure_channel(address) as channel:
        stats: worker_pb2.GetWorkerStatsResponse = worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerStats(
            worker_pb2.GetWorkerStatsRequest(), timeout=10
        )
    return stats


def queued_requests(gateway: str, model: str = MODEL) -> int:
    with grpc.insecure_channel(gateway) as channel:
        models = gateway_pb2_grpc.GatewayStub(channel).ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
    return next(int(m.queued_requests) for m in models.models if m.name == model)


def prompt_ids(tokenizer: str, prompt: str, model: str = MODEL) -> list[int]:
    """The token ids the tokenizer service gives `prompt` (what the gateway sends the worker)."""
    entry = tokenizer_pb2.TokenizeEntry(model=model, prompt=prompt, max_input_tokens=10_000)
    with grpc.insecure_channel(tokenizer) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        (result,) = stub.Tokenize(tokenizer_pb2.TokenizeRequest(entries=[entry]), timeout=30).results
    return list(result.token_ids)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, in bytes."""
    return int(psutil.Process(pid).memory_info().rss)


def spawn_service(
    module: str, config: Path, announce: Path, log: Path, extra: list[str] | None = None
) -> subprocess.Popen[bytes]:
    """`python -m <module> --config <config> --announce-file <announce>` on its own, output to `log`."""
    announce.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with log.open("ab") as output:
        return subprocess.Popen(
            [sys.executable, "-m", module, "--config", str(config), "--announce-file", str(announce)]
            + (extra or []),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def stop_process(process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL what outlives `timeout` (a test's own cleanup)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
