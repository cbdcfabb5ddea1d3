"""The launcher starts the real stack (tokenizer, worker, gateway processes) on a tiny model and stops it.

Every service is a real subprocess on an ephemeral port; nothing is mocked. The stack's lifecycle
(ready, serving, a dead child reported, a clean stop with no process left) is one test, since a stack
start costs seconds of CPU on these machines.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import grpc
import psutil
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.worker.settings import WorkerSettings
from strata.cli.launcher import StackError, start_stack
from strata.cli.stack_config import route_options, routes_json, worker_env
from strata.client import StrataClient
from strata.settings import SettingsError
from tests.integration.launcher_harness import gone, write_tiny_config
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from pathlib import Path


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


def test_routes_group_workers_by_model_in_index_order() -> None:
    routes = json.loads(routes_json(["a", "b", "a"], ["h:1", "h:2", "h:3"]))
    assert routes == [{"model": "a", "workers": ["h:1", "h:3"]}, {"model": "b", "workers": ["h:2"]}]


def test_routes_take_the_options_of_their_model_and_pass_others_on() -> None:
    options: list[dict[str, object]] = [
        {"model": "a", "fallback": "b", "ttft_slo_ms": 500.0},
        {"model": "remote", "dns": "workers.svc:50053"},
    ]
    routes = json.loads(routes_json(["a", "b", "a"], ["h:1", "h:2", "h:3"], options))
    assert routes == [
        {"model": "a", "fallback": "b", "ttft_slo_ms": 500.0, "workers": ["h:1", "h:3"]},
        {"model": "b", "workers": ["h:2"]},
        {"model": "remote", "dns": "workers.svc:50053"},
    ]


def test_route_options_that_clash_with_the_workers_are_refused() -> None:
    with pytest.raises(SettingsError, match="twice"):
        routes_json(["a"], ["h:1"], [{"model": "a"}, {"model": "a", "fallback": "b"}])
    with pytest.raises(SettingsError, match="remove its workers key"):
        routes_json(["a"], ["h:1"], [{"model": "a", "workers": ["elsewhere:1"]}])


def test_route_options_must_name_a_model(tmp_path: Path) -> None:
    config = tmp_path / "routes.yaml"
    config.write_text(yaml.safe_dump({"gateway": {"routes": [{"model": "a", "fallback": "b"}]}}))
    assert route_options(config) == [{"model": "a", "fallback": "b"}]
    config.write_text(yaml.safe_dump({"gateway": {"routes": [{"fallback": "b"}]}}))
    with pytest.raises(SettingsError, match="each name a model"):
        route_options(config)
    config.write_text(yaml.safe_dump({"gateway": {"listen": "127.0.0.1:0"}}))
    assert route_options(config) == []


def test_worker_env_carries_the_wait_policy(tiny_serving_dir: Path) -> None:
    base = {"model_name": "tiny", "model_path": tiny_serving_dir}
    assert worker_env(WorkerSettings.build(base)) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert worker_env(WorkerSettings.build({**base, "omp_wait_policy": "ACTIVE"})) == {
        "OMP_WAIT_POLICY": "ACTIVE"
    }
    assert worker_env(WorkerSettings.build({**base, "omp_wait_policy": None})) == {}


@pytest.mark.slow
def test_primary_and_int8_fallback_run_side_by_side(tmp_path: Path, tiny_serving_dir: Path) -> None:
    """The shape of configs/local.yaml on a tiny model: two workers, their own threads and wait policy."""
    path = write_tiny_config(tmp_path / "pair.yaml", tiny_serving_dir, threads=1, omp_wait_policy="ACTIVE")
    config = yaml.safe_load(path.read_text())
    fallback = {
        **config["workers"][0],
        "model_name": "tiny-int8",
        "quantization": "dynamic-int8",
        "omp_wait_policy": "PASSIVE",
    }
    config["workers"].append(fallback)
    config["tokenizer"]["models"]["tiny-int8"] = str(tiny_serving_dir)
    config["gateway"]["routes"] = [harness_route("tiny", fallback="tiny-int8"), harness_route("tiny-int8")]
    path.write_text(yaml.safe_dump(config))
    with start_stack(path, log_dir=tmp_path / "logs", ready_timeout_s=300) as stack:
        assert stack.worker_models == ("tiny", "tiny-int8")
        environ = {name: psutil.Process(pid).environ() for name, pid in stack.pids.items()}
        assert environ["worker 0"]["OMP_WAIT_POLICY"] == "ACTIVE"
        assert environ["worker 1"]["OMP_WAIT_POLICY"] == "PASSIVE"
        routes = json.loads(environ["gateway"]["STRATA_GATEWAY_ROUTES"])
        assert [(r["model"], r.get("fallback")) for r in routes] == [
            ("tiny", "tiny-int8"),
            ("tiny-int8", None),
        ]
        with StrataClient(stack.addresses.gateway) as client:
            models = {m.name: m for m in client.list_models(timeout=30).models}
            assert set(models) == {"tiny", "tiny-int8"}
            assert models["tiny"].fallback_model == "tiny-int8"
            assert models["tiny"].tokenizer_fingerprint == models["tiny-int8"].tokenizer_fingerprint
            reply = client.generate("hello", model="tiny-int8", max_new_tokens=4, ignore_eos=True, timeout=60)
            assert reply.model == "tiny-int8" and reply.usage.output_tokens == 4


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
    config = write_tiny_config(tmp_path / "bad.yaml", tiny_serving_dir, engine={"max_num_seqs": 0})
    before = psutil.Process().children(recursive=True)
    with pytest.raises(SettingsError, match="max_num_seqs"):
        start_stack(config, ready_timeout_s=10)
    assert psutil.Process().children(recursive=True) == before


def test_a_config_without_workers_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "empty.yaml"
    config.write_text("tokenizer: {models: {x: /nowhere}}\nworkers: []\n")
    with pytest.raises(SettingsError, match="at least one worker"):
        start_stack(config, ready_timeout_s=10)
