"""docker-compose.yml run for real: the images `make images` built, the core stack (tokenizer, worker,
its fallback, gateway; the observability services sit behind their profile), reached only through
the ports compose publishes. `make compose-test` runs this module; elsewhere it skips (conftest.py).

The override tests/containers/compose.test.yml changes what a test run must: the gateway's ports are
published on ports the OS picks, on 127.0.0.1, and the `models` volume is this checkout's models/
(fetched by `make model`), so the fetch-model service runs its real command and finds the models
complete. The order of the tests is the order of a deployment's life: healthy, answering over gRPC
(a client that knows the API only by reflection) and HTTP (the openai SDK), a worker killed
mid-stream and restarted by compose's restart policy, logs, then down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import openai
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from strata.client import StrataClient
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from container_engine import Engine, engine  # noqa: E402

if TYPE_CHECKING:
    from strata.v1 import gateway_pb2

BASE = ROOT / "docker-compose.yml"
OVERRIDE = Path(__file__).with_name("compose.test.yml")
CORE = ("tokenizer", "worker", "worker-fallback", "gateway")
PRIMARY, FALLBACK = "smollm2-135m-instruct", "smollm2-135m-instruct-int8"
QUESTION = "What is the capital of France? Answer in one word."
# Up to healthy is about a minute here (two model loads, the fallback's quantization); five times it.
HEALTHY_TIMEOUT_S = 600.0
RESTART_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 120.0
RECORD_ENV = "STRATA_COMPOSE_RECORD"


@dataclass
class Stack:
    docker: Engine
    project: str
    figures: dict[str, float] = field(default_factory=dict)

    def compose(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = ["docker", "compose", "-p", self.project, "-f", str(BASE), "-f", str(OVERRIDE), *args]
        return subprocess.run(command, cwd=ROOT, env=self.env, check=check, capture_output=True, text=True)

    @property
    def env(self) -> dict[str, str]:
        return {**self.docker.env, "STRATA_MODELS_DIR": str(ROOT / "models")}

    def containers(self) -> dict[str, dict[str, Any]]:
        """`docker inspect` of each core service's container, by service name."""
        found = {}
        for service in CORE:
            ids = self.compose("ps", "--all", "-q", service).stdout.split()
            if ids:
                inspected = self.docker.docker("inspect", ids[0]).stdout
                found[service] = json.loads(inspected)[0]
        return found

    def health(self) -> dict[str, str]:
        return {
            name: c["State"].get("Health", {}).get("Status", "none") for name, c in self.containers().items()
        }

    def published(self, port: int) -> str:
        return self.compose("port", "gateway", str(port)).stdout.strip()


def _down(stack: Stack) -> None:
    stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "60", check=False)


@pytest.fixture(scope="module")
def stack() -> Any:
    models = ROOT / "models"
    if not (models / "SmolLM2-135M-Instruct").is_dir():
        pytest.fail(f"{models} has no default model: run `make model` first")
    from bench.provenance import start_provenance

    running = Stack(engine(), f"strata-test-{os.getpid()}")
    provenance = start_provenance()
    started = time.monotonic()
    up = running.compose("up", "--detach", "--no-build", check=False)
    try:
        assert up.returncode == 0, up.stderr
        wait_for(
            lambda: running.health() == dict.fromkeys(CORE, "healthy"),
            HEALTHY_TIMEOUT_S,
            lambda: f"every core container healthy (now {running.health()})",
            interval_s=1.0,
        )
        running.figures["up_to_healthy_s"] = round(time.monotonic() - started, 1)
        yield running
    finally:
        _down(running)
        record = os.environ.get(RECORD_ENV)
        if record and running.figures:
            _write_record(Path(record), running, provenance)


def _write_record(path: Path, stack: Stack, provenance: dict[str, Any]) -> None:
    from bench.provenance import finish_provenance

    record = {
        "engine": stack.docker.version,
        "services": list(CORE),
        "figures": stack.figures,
        "provenance": finish_provenance(provenance),
    }
    path.write_text(json.dumps(record, indent=2) + "\n")


def test_every_core_container_turns_healthy(stack: Stack) -> None:
    assert stack.health() == dict.fromkeys(CORE, "healthy")
    for name, container in stack.containers().items():
        assert container["State"]["Running"], name
        assert container["HostConfig"]["CapDrop"] == ["ALL"], name


def _reflected_call(address: str, method: str, request: dict[str, Any]) -> dict[str, Any]:
    """Call `method` ("package.Service/Method") knowing nothing but the server's reflection, as
    grpcurl does: the request and response types come from the server, not from generated code.
    (grpcurl itself is in none of the package sources this machine reaches: not PyPI, npm or Debian.)"""
    service, name = method.split("/")
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        pool = descriptor_pool.DescriptorPool(database)
        rpc = pool.FindServiceByName(service).FindMethodByName(name)
        request_type = message_factory.GetMessageClass(rpc.input_type)
        response_type = message_factory.GetMessageClass(rpc.output_type)
        call = channel.unary_unary(
            f"/{method}",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=response_type.FromString,
        )
        reply = call(json_format.ParseDict(request, request_type()), timeout=CALL_TIMEOUT_S)
        return dict(json_format.MessageToDict(reply, preserving_proto_field_name=True))


def test_a_reflection_client_gets_paris_over_grpc_and_the_answer_names_its_model(stack: Stack) -> None:
    request = {"messages": [{"role": "user", "content": QUESTION}], "sampling": {"max_new_tokens": 16}}
    reply = _reflected_call(stack.published(50051), "strata.v1.Gateway/Generate", request)
    assert "Paris" in reply["text"], reply
    assert reply["model"] == PRIMARY


def test_the_openai_sdk_gets_paris_over_http_and_the_answer_names_its_model(stack: Stack) -> None:
    client = openai.OpenAI(
        base_url=f"http://{stack.published(8000)}/v1", api_key="unused", timeout=CALL_TIMEOUT_S
    )
    completion = client.chat.completions.create(
        model=PRIMARY, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0
    )
    assert "Paris" in (completion.choices[0].message.content or "")
    assert completion.model == PRIMARY


def test_a_killed_worker_fails_over_mid_stream_and_comes_back_without_a_gateway_restart(stack: Stack) -> None:
    """SIGKILL of the primary's process, from the host, 8 tokens into a 200-token stream, as a crash
    or the kernel's OOM killer ends it: the stream ends on the fallback with every token; the restart
    policy brings the worker back, and the same gateway (not restarted) serves the primary again.
    Not `docker kill`: Docker marks a container it was told to kill as stopped by hand, and its restart
    policies leave such a container down by design."""
    before = stack.containers()
    gateway_started = before["gateway"]["State"]["StartedAt"]
    with StrataClient(stack.published(50051)) as client:
        stream = client.generate_stream(
            messages=[("user", "Count from one to one hundred in words.")],
            max_new_tokens=200,
            ignore_eos=True,
            timeout=CALL_TIMEOUT_S,
        )
        tokens: list[int] = []
        final = None
        killed_at: float | None = None
        for message in stream:
            tokens.extend(message.token_ids)
            if len(tokens) >= 8 and killed_at is None:
                os.kill(int(before["worker"]["State"]["Pid"]), signal.SIGKILL)
                killed_at = time.monotonic()
            if message.HasField("final"):
                final = message.final
        assert final is not None and killed_at is not None
        assert len(tokens) == 200 and list(final.token_ids) == tokens
        assert final.model == FALLBACK and final.failover_at_token >= 8, final

        def restarted() -> bool:
            worker = stack.containers().get("worker")
            return worker is not None and worker["State"].get("Health", {}).get("Status") == "healthy"

        wait_for(
            restarted,
            RESTART_TIMEOUT_S,
            lambda: f"the worker back and healthy ({stack.health()})",
            interval_s=1.0,
        )
        stack.figures["worker_restart_to_healthy_s"] = round(time.monotonic() - killed_at, 1)

        def on_the_primary() -> gateway_pb2.GenerateResponse | None:
            reply = client.generate(QUESTION, max_new_tokens=4, timeout=CALL_TIMEOUT_S)
            return reply if reply.model == PRIMARY else None

        wait_for(
            on_the_primary, RESTART_TIMEOUT_S, "the gateway routing to the restarted primary", interval_s=1.0
        )
    after = stack.containers()
    assert after["worker"]["RestartCount"] >= 1 or after["worker"]["Id"] != before["worker"]["Id"]
    assert after["gateway"]["State"]["StartedAt"] == gateway_started and after["gateway"]["RestartCount"] == 0


def test_the_logs_show_the_native_kernels_on_and_no_traceback(stack: Stack) -> None:
    with StrataClient(stack.published(50051)) as client:
        models = {m.name: list(m.native_kernels) for m in client.list_models(timeout=CALL_TIMEOUT_S).models}
    for name in (PRIMARY, FALLBACK):
        assert models[name] and all(state.startswith("on (") for state in models[name]), models
    for service in CORE:
        logs = stack.compose("logs", "--no-color", service).stdout
        assert "Traceback" not in logs, f"{service} logged a traceback:\n{logs[-3000:]}"
        if service.startswith("worker"):
            assert "native CPU kernels: on (" in logs, f"{service} never said its native kernels are on"


def test_compose_down_leaves_no_container_network_or_volume(stack: Stack) -> None:
    _down(stack)
    label = f"label=com.docker.compose.project={stack.project}"
    assert stack.docker.docker("ps", "--all", "--quiet", "--filter", label).stdout.split() == []
    assert stack.docker.docker("network", "ls", "--quiet", "--filter", label).stdout.split() == []
    assert stack.docker.docker("volume", "ls", "--quiet", "--filter", label).stdout.split() == []
    assert (ROOT / "models" / "SmolLM2-135M-Instruct").is_dir(), "down removed the bound models folder"
