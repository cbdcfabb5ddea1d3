"""`python -m gateway`: bad settings exit 2 with the reason; a running gateway announces, reports
NOT_SERVING while its backends are missing, and stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.server import main
from tests.polling import announced_address

if TYPE_CHECKING:
    from pathlib import Path

    import pytest


def test_bad_settings_exit_2_naming_the_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("gateway:\n  routes: []\n  tokenizer_address: 127.0.0.1:1\n")
    assert main(["--config", str(config)]) == 2
    assert "routes" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_runs_not_serving_without_backends_and_stops_on_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "stack.yaml"
    # Port 9 (discard) on loopback: nothing listens there, so the backends stay unreachable.
    config.write_text(
        "gateway:\n  listen: 127.0.0.1:0\n  tokenizer_address: 127.0.0.1:9\n"
        "  routes: [{model: tiny, workers: ['127.0.0.1:9']}]\n  connect_timeout_s: 0.5\n"
    )
    announce = tmp_path / "gateway.addr"
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--config", str(config), "--announce-file", str(announce)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = announced_address(process, announce, 60)
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(
                health_pb2.HealthCheckRequest(service="strata.v1.Gateway"), timeout=10
            ).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
        assert "gateway stopping" in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
