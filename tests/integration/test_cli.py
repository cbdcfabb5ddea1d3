"""The `strata` command line against the real stack: generate, models, and `strata up` as an operator runs it.

Every command runs as a subprocess (`python -m strata.cli`), against real services on ephemeral ports
serving the tiny model (one stack per module, started by the launcher), or started by `strata up`
itself. Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

import httpx2
import pytest
import yaml

from services.worker.model import native
from strata.cli.launcher import start_stack
from strata.settings import DEFAULT_CONFIG
from tests.integration.launcher_harness import gone, write_tiny_config
from tests.integration.up_harness import strata_up

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.slow


def strata(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strata.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, tiny_serving_dir: Path) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("cli-stack")
    config = write_tiny_config(directory / "stack.yaml", tiny_serving_dir)
    with start_stack(config, log_dir=directory / "logs", ready_timeout_s=300) as stack:
        yield stack.addresses.gateway


def generate_json(gateway: str, *args: str) -> dict[str, object]:
    done = strata("generate", "hello there", "--address", gateway, "--json", *args)
    assert done.returncode == 0, done.stderr
    reply: dict[str, object] = json.loads(done.stdout)
    return reply


def test_generate_json_prints_the_whole_response(gateway: str) -> None:
    reply = generate_json(gateway, "--max-new-tokens", "6")
    assert reply["model"] == "tiny"
    assert reply["finishReason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
    usage = reply["usage"]
    assert isinstance(usage, dict)
    assert 1 <= usage["outputTokens"] <= 6
    assert usage["inputTokens"] > 0
    assert "totalMs" in reply["timing"]  # type: ignore[operator]


def test_streamed_text_equals_the_unary_text(gateway: str) -> None:
    reply = generate_json(gateway, "--max-new-tokens", "8")
    done = strata("generate", "hello there", "--address", gateway, "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{reply['text']}\n"


def test_chat_applies_the_template_and_timing_goes_to_stderr(gateway: str) -> None:
    raw = generate_json(gateway, "--max-new-tokens", "2")
    chat = generate_json(gateway, "--chat", "--system", "be brief", "--max-new-tokens", "2")
    assert chat["usage"]["inputTokens"] > raw["usage"]["inputTokens"]  # type: ignore[index]

    done = strata("generate", "hello", "--address", gateway, "--chat", "--timing", "--max-new-tokens", "3")
    assert done.returncode == 0, done.stderr
    for stage in ("network", "preprocess", "queue", "forward", "decode", "TTFT", "total"):
        assert re.search(rf"^{stage} +\d+\.\d ms +\d+\.\d%", done.stderr, re.MULTILINE), done.stderr
    forward = re.search(r"^forward .*%  +(\S+)$", done.stderr, re.MULTILINE)
    assert forward is not None and set(forward[1]) <= set("▏▎▍▌▋▊▉█"), done.stderr
    assert "\x1b[" not in done.stderr, "no colour when stderr is not a terminal"
    assert "model tiny" in done.stderr
    assert "timing" not in done.stdout


def test_logprobs_flag_prints_each_token_and_its_alternatives(gateway: str) -> None:
    reply = generate_json(gateway, "--max-new-tokens", "4", "--logprobs", "3", "--min-tokens", "4")
    positions, ids = reply["logprobs"], reply["tokenIds"]
    assert isinstance(positions, list) and isinstance(ids, list) and len(positions) == len(ids) == 4
    assert all(len(p["top"]) == 3 and p["chosen"]["logprob"] <= 0 for p in positions)
    done = strata("generate", "hello there", "--address", gateway, "--max-new-tokens", "4", "--logprobs", "2")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    # One line per token: its logprob first, then its text and two alternatives with theirs.
    assert len(lines) >= 1 and all(float(line.split()[0]) <= 0 for line in lines[:4])


def test_n_flag_prints_every_sample(gateway: str) -> None:
    done = strata("generate", "hello there", "--address", gateway, "--max-new-tokens", "4", "--n", "3")
    assert done.returncode == 0, done.stderr
    texts = re.split(r"^\[\d\] ", done.stdout, flags=re.M)
    assert re.findall(r"^\[(\d)\] ", done.stdout, flags=re.M) == ["0", "1", "2"]
    # Greedy samples are identical.
    assert texts[0] == "" and len(set(texts[1:])) == 1


def test_grpc_errors_print_code_and_message(gateway: str) -> None:
    done = strata("generate", "hello", "--address", gateway, "--model", "nope")
    assert done.returncode == 1
    assert done.stderr.startswith("error: NOT_FOUND: "), done.stderr
    assert "nope" in done.stderr
    done = strata("generate", "hello", "--address", gateway, "--top-p", "1.5")
    assert done.returncode == 1
    assert done.stderr.startswith("error: INVALID_ARGUMENT: "), done.stderr
    assert "top_p" in done.stderr


def test_models_lists_the_route(gateway: str) -> None:
    done = strata("models", "--address", gateway)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("tiny"))
    # KV TOKENS: the tiny config's 128 blocks of 16 tokens, and the cache's format.
    assert row.split()[:8] == ["tiny", "*", "llama", "256", "2048", "(float32)", "1/1", "ready"]
    header = done.stdout.splitlines()[0]
    assert header.rstrip().endswith("NATIVE KERNELS")
    # The worker is a process of this machine, started with this environment: its kernels' state is
    # the one this process finds, then the native paths its model's family takes.
    kernels = row[header.index("NATIVE KERNELS") :].strip()
    assert kernels == f"{native.status()}; native decode stack and kernels"
    assert row[header.index("WEIGHTS") : header.index("NATIVE KERNELS")].strip() == "float32"


def test_address_comes_from_the_environment(gateway: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "strata.cli", "models"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "STRATA_ADDRESS": gateway},
    )
    assert done.returncode == 0, done.stderr
    assert "tiny" in done.stdout


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_up_serves_until_stopped_and_leaves_no_process(
    tmp_path: Path, tiny_serving_dir: Path, stop_signal: signal.Signals
) -> None:
    with strata_up(tmp_path, tiny_serving_dir) as (up, children):
        assert len(children) == 3
        # Run as `python -m strata.cli`, so the example names that command (it is not on PATH).
        assert any(
            line.startswith("try: ") and "-m strata.cli generate" in line and "--chat" in line
            for line in up.lines
        )
        done = strata("generate", "hello", "--address", str(up.gateway), "--max-new-tokens", "3")
        assert done.returncode == 0, done.stderr
        # The HTTP API is printed and serves from the same gateway process, and stops with it.
        assert up.http is not None and up.http.endswith("/v1")
        reply = httpx2.post(f"{up.http}/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        up.process.send_signal(stop_signal)
        assert up.process.wait(60) == 0, up.stderr()
        assert gone([child.pid for child in children], within_s=5)
        assert "stopping the stack" in up.stderr()


def test_up_with_exit_on_failure_reports_a_dead_child_and_exits_nonzero(
    tmp_path: Path, tiny_serving_dir: Path
) -> None:
    with strata_up(tmp_path, tiny_serving_dir, "--exit-on-failure") as (up, children):
        worker = next(child for child in children if "services.worker" in child.cmdline())
        worker.kill()
        assert up.process.wait(60) != 0
        assert "worker 0 exited with code -9; stopping the stack" in up.stderr()
        assert gone([child.pid for child in children], within_s=5)


@pytest.mark.skipif(sys.platform != "linux", reason="the parent death signal is Linux-only")
def test_children_stop_when_strata_up_is_killed(tmp_path: Path, tiny_serving_dir: Path) -> None:
    with strata_up(tmp_path, tiny_serving_dir) as (up, children):
        up.process.kill()
        up.process.wait(30)
        assert gone([child.pid for child in children], within_s=60)


@pytest.mark.real_model
def test_real_model_knows_the_capital_of_france(tmp_path: Path, real_model_dir: Path) -> None:
    """The default config (fetched model, real engine settings), with only the gateway on a free port."""

    def absolute(path: str) -> str:
        return str((DEFAULT_CONFIG.parent / path).resolve())

    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    models = config["tokenizer"]["models"]
    config["tokenizer"]["models"] = {name: absolute(path) for name, path in models.items()}
    from strata.cli.model_fetch import fallback_model_dir

    fetched = {str(real_model_dir.resolve()), str(fallback_model_dir(real_model_dir.parent).resolve())}
    for worker in config["workers"]:
        worker["model_path"] = absolute(worker["model_path"])
        assert worker["model_path"] in fetched  # the primary and its int8 fallback, both fetched
    config["gateway"]["listen"] = "127.0.0.1:0"
    config["gateway"]["http_listen"] = "127.0.0.1:0"
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    with start_stack(path, log_dir=tmp_path / "logs", ready_timeout_s=600) as stack:
        done = strata(
            "generate",
            "What is the capital of France?",
            "--chat",
            "--max-new-tokens",
            "32",
            "--address",
            stack.addresses.gateway,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
