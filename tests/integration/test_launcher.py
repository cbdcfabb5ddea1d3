"""The launcher starts the real stack (tokenizer, worker, gateway processes) on a tiny model and stops it.

Every service is a real subprocess on an ephemeral port; nothing is mocked. The stack's lifecycle
(ready, serving, a dead child reported, a clean stop with no process left) is one test, since a stack
start costs seconds of CPU on these machines.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import grpc
import psutil
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from strata.client import StrataClient
from strata.launcher import StackError, routes_json, start_stack

if TYPE_CHECKING:
    from pathlib import Path


def write_tiny_config(path: Path, model_dir: Path, **worker_overrides: object) -> Path:
    """A stack config serving `model_dir` as model "tiny", every service on a free port."""
    worker = {
        "model_name": "tiny",
        "model_path": str(model_dir),
        "listen": "127.0.0.1:0",
        "device": "cpu",
        "threads": 1,
        "engine": {"num_blocks": 128, "max_num_seqs": 16},
        **worker_overrides,
    }
    config = {
        "tokenizer": {"listen": "127.0.0.1:0", "models": {"tiny": str(model_dir)}},
        "workers": [worker],
        "gateway": {"listen": "127.0.0.1:0", "default_model": "tiny"},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def health_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


def reflected_services(address: str) -> set[str]:
    """The service names a server lists through gRPC reflection."""
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    return {service.name for reply in replies for service in reply.list_services_response.service}


def running(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def gone(pids: list[int], within_s: float) -> bool:
    """Whether every process in `pids` has ended within `within_s` seconds."""
    end = time.monotonic() + within_s
    while any(running(pid) for pid in pids):
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)
    return True


def test_routes_group_workers_by_model_in_index_order() -> None:
    routes = json.loads(routes_json(["a", "b", "a"], ["h:1", "h:2", "h:3"]))
    assert routes == [{"model": "a", "workers": ["h:1", "h:3"]}, {"model": "b", "workers": ["h:2"]}]


@pytest.mark.slow
def test_stack_serves_reports_a_dead_child_and_stops_cleanly(tmp_path: Path, tiny_serving_dir: Path) -> None:
    config = write_tiny_config(tmp_path / "stack.yaml", tiny_serving_dir)
    stack = start_stack(config, log_dir=tmp_path / "logs", ready_timeout_s=300)
    try:
        addresses = stack.addresses
        assert set(stack.pids) == {"tokenizer", "worker 0", "gateway"}
        for address in (addresses.gateway, addresses.tokenizer, *addresses.workers):
            assert not address.endswith(":0")
            assert health_status(address) == health_pb2.HealthCheckResponse.SERVING
        common = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
        assert reflected_services(addresses.gateway) == {"strata.v1.Gateway", *common}
        assert reflected_services(addresses.tokenizer) == {"strata.v1.TokenizerService", *common}
        assert reflected_services(addresses.workers[0]) == {"strata.v1.WorkerService", *common}
        with StrataClient(addresses.gateway) as client:
            models = client.list_models(timeout=30)
            assert [(m.name, m.ready_workers, m.configured_workers) for m in models.models] == [
                ("tiny", 1, 1)
            ]
            reply = client.generate("hello", max_new_tokens=4, ignore_eos=True, timeout=60)
            assert reply.model == "tiny" and reply.usage.output_tokens == 4
        assert (tmp_path / "logs" / "worker-0.log").stat().st_size > 0
        assert stack.poll() is None
        assert stack.wait(timeout=0.5) is None

        psutil.Process(stack.pids["worker 0"]).kill()
        ended = stack.wait(timeout=60)
        assert ended is not None
        assert (ended.name, ended.returncode) == ("worker 0", -9)
        assert str(ended) == "worker 0 exited with code -9"
    finally:
        pids = list(stack.pids.values())
        exits = stack.stop(timeout=60)
    codes = {ended.name: ended.returncode for ended in exits}
    assert codes == {"tokenizer": 0, "worker 0": -9, "gateway": 0}
    assert gone(pids, within_s=5)
    assert stack.stop() == exits


@pytest.mark.slow
def test_a_child_failing_at_start_is_named_with_its_code_and_log(
    tmp_path: Path, tiny_serving_dir: Path
) -> None:
    missing = tmp_path / "no-such-model"
    config = write_tiny_config(tmp_path / "bad.yaml", tiny_serving_dir, model_path=str(missing))
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(StackError) as raised:
        start_stack(config, log_dir=tmp_path / "logs", ready_timeout_s=300)
    message = str(raised.value)
    assert "worker 0 exited with code" in message
    assert "exited with code 0" not in message
    assert "no-such-model" in message  # the tail of the worker's own log says what was wrong
    after = {child.pid for child in psutil.Process().children(recursive=True)}
    assert gone(list(after - before), within_s=5)


def test_worker_settings_are_checked_before_anything_starts(tmp_path: Path, tiny_serving_dir: Path) -> None:
    from strata.settings import SettingsError

    config = write_tiny_config(tmp_path / "bad.yaml", tiny_serving_dir, engine={"max_num_seqs": 0})
    before = psutil.Process().children(recursive=True)
    with pytest.raises(SettingsError, match="max_num_seqs"):
        start_stack(config, ready_timeout_s=10)
    assert psutil.Process().children(recursive=True) == before


def test_a_config_without_workers_is_refused(tmp_path: Path) -> None:
    from strata.settings import SettingsError

    config = tmp_path / "empty.yaml"
    config.write_text("tokenizer: {models: {x: /nowhere}}\nworkers: []\n")
    with pytest.raises(SettingsError, match="at least one worker"):
        start_stack(config, ready_timeout_s=10)
