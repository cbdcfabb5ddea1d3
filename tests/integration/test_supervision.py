"""`strata up` keeps its stack serving: a killed worker, tokenizer or gateway is started again on the
address the others know, the gateway uses a restarted worker without a restart of its own, and on the
default model a killed primary's route is served by the fallback at once and by the primary again
once it is back.

Everything runs through the real `strata up` command (a subprocess), its real child processes and
the real gateway; faults are real signals. Times are recorded for the reliability report (row 16);
bounds are 5x the targets (the fallback
serves within 1 s of a kill, the primary again within 60 s, requests succeed again within 10 s of the
tokenizer's kill).
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

import grpc
import pytest

from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.up_harness import default_config, running_up, strata_up
from tests.polling import seconds_until

if TYPE_CHECKING:
    from pathlib import Path

    import psutil

    from tests.figures import Figure
    from tests.integration.up_harness import Up

SCENARIO = 16  # the reliability report's row for strata up's supervision

pytestmark = pytest.mark.slow


def child(up: Up, module: str) -> psutil.Process:
    """The running child of `strata up` that serves `module` (services.worker --index 0, ...)."""
    return next(p for p in up.children() if module in " ".join(p.cmdline()) and p.status() != "zombie")


def served_by(address: str, timeout_s: float = 10.0) -> str:
    """The model that served one short request, or "" when the request failed."""
    request = gateway_pb2.GenerateRequest(
        prompt="hello", sampling=common_pb2.SamplingParams(max_new_tokens=2)
    )
    with grpc.insecure_channel(address) as channel:
        try:
            reply = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=timeout_s)
        except grpc.RpcError:
            return ""
    return str(reply.model)


def kill(process: psutil.Process) -> float:
    process.send_signal(signal.SIGKILL)
    return time.monotonic()


def test_a_killed_worker_comes_back_on_its_address_and_the_gateway_uses_it(
    tmp_path: Path, tiny_serving_dir: Path, figure: Figure
) -> None:
    with strata_up(tmp_path, tiny_serving_dir) as (up, _):
        worker = child(up, "services.worker")
        address = next(line.split()[2] for line in up.lines if line.strip().startswith("worker 0"))
        kill(worker)
        back = seconds_until(
            lambda: f"worker 0 is back at {address}" in up.stderr(), 120, "worker 0 back on its address"
        )
        figure(SCENARIO, "tiny worker SERVING again on its address after kill -9", back, "s")
        stderr = up.stderr()
        assert "worker 0 was killed by SIGKILL (code -9); starting it again in 0.5 s" in stderr
        assert "its last lines:" in stderr  # the dead child's own output, for whoever reads the terminal
        assert child(up, "services.worker").pid != worker.pid
        seconds_until(lambda: served_by(up.gateway or "") == "tiny", 30, "the restarted worker serves")
        assert up.process.poll() is None


def test_a_killed_tokenizer_and_a_killed_gateway_come_back(
    tmp_path: Path, tiny_serving_dir: Path, figure: Figure
) -> None:
    with strata_up(tmp_path, tiny_serving_dir) as (up, _):
        gateway = up.gateway or ""
        killed = kill(child(up, "services.tokenizer"))
        seconds_until(
            lambda: served_by(gateway, 2.0) == "tiny", 50, "requests succeed after the tokenizer died"
        )
        figure(
            SCENARIO,
            "tiny stack: requests succeed after the tokenizer's kill -9",
            time.monotonic() - killed,
            "s",
        )
        old_gateway = child(up, "-m gateway")
        killed = kill(old_gateway)
        seconds_until(lambda: "gateway is back at" in up.stderr(), 120, "the gateway is back")
        seconds_until(lambda: served_by(gateway, 2.0) == "tiny", 30, "the gateway serves on its old address")
        figure(
            SCENARIO,
            "tiny stack: requests succeed on the old address after the gateway's kill -9",
            time.monotonic() - killed,
            "s",
        )
        assert child(up, "-m gateway").pid != old_gateway.pid


@pytest.mark.real_model
def test_under_strata_up_a_killed_primary_is_served_by_the_fallback_then_by_itself(
    tmp_path: Path, real_model_dir: Path, figure: Figure
) -> None:
    """The default config, as `make run` starts it (only the gateway on a free port)."""
    path, config = default_config(tmp_path)
    primary, fallback = (worker["model_name"] for worker in config["workers"])
    env = {key: value for key, value in os.environ.items() if not key.startswith("STRATA_")}
    with running_up(path, tmp_path / "up.stderr", env=env, ready_s=600) as (up, _):
        gateway = up.gateway or ""
        assert served_by(gateway, 60) == primary
        killed = kill(child(up, "--index 0"))
        seconds_until(lambda: served_by(gateway, 2.0) == fallback, 5, "the fallback serves")
        on_fallback = time.monotonic() - killed
        seconds_until(lambda: served_by(gateway, 5.0) == primary, 300, "the primary serves again")
        on_primary = time.monotonic() - killed
        figure(SCENARIO, "default model: the fallback serves after the primary's kill -9", on_fallback, "s")
        figure(SCENARIO, "default model: the primary serves again after its kill -9", on_primary, "s")
        killed = kill(child(up, "services.tokenizer"))
        seconds_until(
            lambda: served_by(gateway, 2.0) != "", 50, "requests succeed after the tokenizer's kill"
        )
        figure(
            SCENARIO,
            "default model: requests succeed after the tokenizer's kill -9",
            time.monotonic() - killed,
            "s",
        )
        assert on_fallback < 5.0 and on_primary < 300.0  # the targets: 1 s and 60 s
