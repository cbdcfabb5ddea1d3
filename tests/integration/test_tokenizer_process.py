"""The tokenizer service as a real process: `python -m services.tokenizer` started from a config file.

It serves until SIGTERM and then exits 0, exits 2 with the offending setting named on bad settings, and
never imports torch or transformers. The gRPC behaviour itself is tested in-process in
tests/integration/test_tokenizer_service.py; this module only checks what needs a separate process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.tokenizer.server import SERVICE_NAME
from strata.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tests.polling import announced_address, wait_for

REPO = Path(__file__).resolve().parents[2]


def test_the_process_serves_until_sigterm(tiny_serving_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "stack.yaml"
    config.write_text(
        yaml.safe_dump({"tokenizer": {"listen": "127.0.0.1:0", "models": {"tiny": str(tiny_serving_dir)}}})
    )
    announce = tmp_path / "tokenizer.addr"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_TOKENIZER_")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.tokenizer",
            "--config",
            str(config),
            "--announce-file",
            str(announce),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = announced_address(process, announce, 60)
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            wait_for(
                lambda: health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10).status,
                60,
                "SERVING",
                until=lambda status: status == health_pb2.HealthCheckResponse.SERVING,
                interval_s=0.05,
            )
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            reply = stub.Tokenize(
                tokenizer_pb2.TokenizeRequest(
                    entries=[tokenizer_pb2.TokenizeEntry(model="tiny", prompt="hi")]
                ),
                timeout=10,
            )
            assert len(reply.results[0].token_ids) > 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"models": {}}, "tokenizer.models"),
        ({"models": {"ghost": "/nonexistent/model"}}, "has no tokenizer.json"),
    ],
)
def test_bad_settings_exit_2(tmp_path: Path, section: dict[str, Any], message: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"tokenizer": {"listen": "127.0.0.1:0", **section}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_TOKENIZER_")}
    result = subprocess.run(
        [sys.executable, "-m", "services.tokenizer", "--config", str(config)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_the_service_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "import services.tokenizer.server, services.tokenizer.tokenize, services.tokenizer.detokenize\n"
        "import services.tokenizer.__main__\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "print('clean')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"
