"""Scale-out across replicas: two worker processes of one model behind one gateway, found by a name.

Both replicas listen on the same port of two loopback addresses (127.0.0.1 and 127.0.0.2), and one
host name resolves to both, as a Kubernetes headless service's name resolves to its pods. The name
comes from a hosts file that nss_wrapper (Debian's libnss-wrapper, LD_PRELOADed into the stack's
processes) puts in front of the system's resolver: real getaddrinfo, no change to the machine. The
route is `dns: workers.strata.test:<port>`. The port is the one the OS gave the first replica (a
worker process started alone on 127.0.0.1:0, its address read from its announce file); the stack's
worker then binds the same port on 127.0.0.2.

While clients stream greedy requests of one prompt, the stack's replica is killed with SIGKILL at a
moment it runs at least two of them; traffic goes on on the other. No request may fail, before its
first token or mid-stream: a stream the kill cut is continued on the survivor (`failover_at_token`
says after how many tokens), and every stream's tokens must equal the greedy reference of the
in-process engine, token for token (for a continued one: the reference's first `failover_at_token`
tokens, then the engine's greedy continuation of the prompt plus those, which is what the survivor
computes). The kill waits, bounded, until the gateway has submitted to both replicas; the clients
stop once CLIENTS requests sent after the kill have completed and the survivor has taken more than
CLIENTS new submissions (or WAIT_S has passed, and the assertions say what went wrong). These figures
are scenario 12 of the reliability report.
"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from strata.cli.launcher import start_stack
from strata.sampling import SamplingParams
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.polling import announced_address, poll, seconds_until, wait_for
from tests.reliability.harness import SERVING, health, prompt_ids, spawn_service, stop_process, worker_stats
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from strata.cli.launcher import Stack
    from tests.figures import Figure

pytestmark = pytest.mark.slow

NAME = "workers.strata.test"
REPLICAS = ("127.0.0.1", "127.0.0.2")
"""The survivor (started alone) and the victim (the stack's worker)."""
STEP_DELAY_S = 0.02
NEW_TOKENS = 24
CLIENTS = 6
PROMPT = "The capital of France"
WAIT_S = 60.0
ENGINE: dict[str, Any] = {"num_blocks": 128, "max_num_seqs": 8}


def nss_wrapper() -> str:
    """The nss_wrapper library; the test fails (it does not skip) without it."""
    found = sorted(glob.glob("/usr/lib/*/libnss_wrapper.so")) + sorted(
        glob.glob("/usr/lib/libnss_wrapper.so")
    )
    assert found, (
        "libnss_wrapper.so is missing: apt-get install libnss-wrapper (scripts/install_test_deps.sh)"
    )
    return found[0]


@dataclass
class Replicas:
    stack: Stack
    survivor: str
    """host:port of the replica started alone, on REPLICAS[0]."""


def _worker(model_dir: Path, listen: str) -> dict[str, Any]:
    engine = {**ENGINE, "enable_fault_injection": True, "fault_step_delay_s": STEP_DELAY_S}
    return {
        "listen": listen,
        "model_name": "tiny",
        "model_path": str(model_dir),
        "device": "cpu",
        "threads": 1,
        "engine": engine,
    }


@pytest.fixture(scope="module")
def replicas(tiny_serving_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    directory = tmp_path_factory.mktemp("scale-out")
    (directory / "logs").mkdir()
    alone = directory / "survivor.yaml"
    alone.write_text(yaml.safe_dump({"workers": [_worker(tiny_serving_dir, f"{REPLICAS[0]}:0")]}))
    announce = directory / "survivor.addr"
    process = spawn_service(
        "services.worker", alone, announce, directory / "logs" / "survivor.log", ["--index", "0"]
    )
    try:
        survivor = announced_address(process, announce, 120)
        seconds_until(lambda: health(survivor) == SERVING, 300, "the survivor replica SERVING")
        port = survivor.rsplit(":", 1)[1]
        hosts = directory / "hosts"
        hosts.write_text("".join(f"{address} {NAME}\n" for address in REPLICAS))
        config = {
            "telemetry": {"log_format": "text"},
            "tokenizer": {"listen": "127.0.0.1:0", "models": {"tiny": str(tiny_serving_dir)}},
            "workers": [_worker(tiny_serving_dir, f"{REPLICAS[1]}:{port}")],
            "gateway": {
                "listen": "127.0.0.1:0",
                "routes": [harness_route("tiny", dns=f"{NAME}:{port}", dns_refresh_s=0.5)],
            },
        }
        path = directory / "stack.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {"LD_PRELOAD": nss_wrapper(), "NSS_WRAPPER_HOSTS": str(hosts)}
        with start_stack(path, env=env, log_dir=directory / "logs") as running:
            yield Replicas(running, survivor)
    finally:
        stop_process(process)


@dataclass
class Outcome:
    started: float
    streamed: bool = False
    """The client had received at least one chunk."""
    error: grpc.StatusCode | None = None
    token_ids: list[int] = field(default_factory=list)
    failover_at_token: int = 0
    """From the final message: the tokens produced before the stream moved to another worker."""


def _client(address: str, stop: threading.Event, outcomes: list[Outcome]) -> None:
    request = gateway_pb2.GenerateRequest(
        model="tiny",
        prompt=PROMPT,
        sampling=common_pb2.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        while not stop.is_set():
            outcome = Outcome(time.monotonic())
            try:
                for chunk in stub.GenerateStream(request, timeout=WAIT_S):
                    outcome.streamed = True
                    outcome.token_ids.extend(chunk.token_ids)
                    if chunk.HasField("final"):
                        outcome.failover_at_token = chunk.final.failover_at_token
            except grpc.RpcError as exc:
                outcome.error = exc.code()  # type: ignore[attr-defined]
            outcomes.append(outcome)


def _submissions(stack: Stack) -> dict[str, float]:
    """strata_gateway_worker_submissions_total per worker address, from the gateway's /metrics."""
    with urllib.request.urlopen(f"http://{stack.metrics_addresses['gateway']}/metrics", timeout=10) as page:
        text = page.read().decode()
    return {
        sample.labels["worker"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "strata_gateway_worker_submissions_total"
    }


class Reference:
    """Greedy tokens of the in-process engine (the same model and engine settings as the replicas)."""

    def __init__(self, model_dir: Path, prompt: list[int]) -> None:
        self._engine = LLMEngine.from_model_dir(model_dir, EngineConfig.model_validate(ENGINE))
        self._prompt = prompt
        self.tokens = self._greedy([], NEW_TOKENS)
        self._continued: dict[int, list[int]] = {}

    def _greedy(self, prior: list[int], count: int) -> list[int]:
        (tokens,) = self._engine.generate(
            [self._prompt + prior], SamplingParams(max_new_tokens=count, ignore_eos=True)
        )
        return list(tokens)

    def expected(self, failover_at_token: int) -> list[int]:
        """A stream's tokens: the reference's, or, for one moved after k tokens, the reference's first k
        and the greedy continuation of the prompt plus those (what the survivor computes)."""
        k = failover_at_token
        if not k:
            return self.tokens
        if k not in self._continued:
            prior = self.tokens[:k]
            self._continued[k] = prior + self._greedy(prior, NEW_TOKENS - k)
        return self._continued[k]


def test_traffic_goes_on_when_one_replica_is_killed(
    replicas: Replicas, tiny_serving_dir: Path, figure: Figure
) -> None:
    stack = replicas.stack
    victim_address = stack.addresses.workers[0]
    with grpc.insecure_channel(stack.addresses.gateway) as channel:
        [model] = gateway_pb2_grpc.GatewayStub(channel).ListModels(gateway_pb2.ListModelsRequest()).models
    assert (model.ready_workers, model.configured_workers) == (2, 2), "both replicas found by the name"
    reference = Reference(tiny_serving_dir, prompt_ids(stack.addresses.tokenizer, PROMPT))

    stop = threading.Event()
    outcomes: list[Outcome] = []
    clients = [
        threading.Thread(target=_client, args=(stack.addresses.gateway, stop, outcomes))
        for _ in range(CLIENTS)
    ]
    for client in clients:
        client.start()
    before = wait_for(
        lambda: _submissions(stack),
        WAIT_S,
        "the gateway submitting to both replicas",
        until=lambda counts: len(counts) == 2 and all(count > 0 for count in counts.values()),
        interval_s=0.1,
    )
    survivor = replicas.survivor
    # Kill it while it runs streams, so some are cut mid-way.
    seconds_until(lambda: worker_stats(victim_address).running >= 2, 10, "two requests on the victim")
    killed_at = time.monotonic()
    os.kill(stack.pids["worker 0"], signal.SIGKILL)

    def traffic_went_on() -> bool:
        """CLIENTS requests sent after the kill have completed, and the survivor took more than CLIENTS
        new submissions (the assertions below say which of them failed, after the figures)."""
        done = sum(1 for o in list(outcomes) if o.error is None and o.started > killed_at)
        return done >= CLIENTS and _submissions(stack).get(survivor, 0) > before[survivor] + CLIENTS

    poll(traffic_went_on, WAIT_S, interval_s=0.1)
    stop.set()
    for client in clients:
        client.join(WAIT_S)
    after = _submissions(stack)

    failed_before_streaming = [o for o in outcomes if o.error is not None and not o.streamed]
    failed_mid_stream = [o for o in outcomes if o.error is not None and o.streamed]
    completed = [o for o in outcomes if o.error is None]
    continued = [o for o in completed if o.failover_at_token]
    exact = [o for o in completed if o.token_ids == reference.expected(o.failover_at_token)]
    done_after_kill = [o for o in completed if o.started > killed_at]
    assert survivor in after and survivor in before, (survivor, after)
    figure(12, "requests", len(outcomes), f"from {CLIENTS} streaming clients")
    figure(12, "failed before their first token", len(failed_before_streaming))
    figure(12, "failed mid-stream", len(failed_mid_stream))
    figure(12, "streams cut by the kill, continued on the survivor", len(continued))
    figure(12, "their failover_at_token", ", ".join(str(o.failover_at_token) for o in continued))
    figure(12, "streams equal to the greedy reference, token for token", len(exact), f"of {len(completed)}")
    figure(12, "requests started and completed after the kill", len(done_after_kill))
    figure(12, "new submissions to the survivor after the kill", after[survivor] - before[survivor])

    assert not failed_before_streaming, f"{len(failed_before_streaming)} requests failed before any token"
    assert not failed_mid_stream, f"{len(failed_mid_stream)} streams failed mid-stream"
    assert continued, "the kill cut no stream, so nothing was continued on the survivor"
    assert all(0 < o.failover_at_token < NEW_TOKENS for o in continued)
    assert len(exact) == len(completed), [
        (o.failover_at_token, o.token_ids) for o in completed if o not in exact
    ]
    assert after[survivor] > before[survivor] + CLIENTS, "the survivor took the traffic"
    assert len(done_after_kill) >= CLIENTS
