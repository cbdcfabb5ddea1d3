"""TLS on every hop, mutual TLS between the services, API keys on the gateway, and what stays private.

Certificates are made at test time with the openssl command: a CA, a server certificate for
127.0.0.1/localhost, a client certificate for the gateway, and a rogue client certificate signed by
nobody the services trust. The tokenizer service and the worker demand a client certificate from
their CA; the gateway speaks TLS to clients, mutual TLS to the services, and wants an API key.

The tests of the three security promises the reliability report lists (keys, client certificates,
plaintext on TLS ports: scenarios 13-15 of scripts/reliability_scenarios.py) record what each call was
answered through the `figure` fixture (tests/figures.py), before they assert it.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import subprocess
from typing import TYPE_CHECKING, Any

import grpc
import httpx2
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.settings import GatewaySettings
from services.tokenizer.settings import TokenizerSettings
from services.worker.settings import WorkerSettings
from strata.cli.launcher import start_stack
from strata.client import StrataClient
from strata.retry import NO_RETRY
from strata.rpc import LIVENESS
from strata.settings import SettingsError
from strata.tls import ClientTlsSettings
from strata.tracing import Tracing
from strata.v1 import tokenizer_pb2, tokenizer_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.secure_harness import SecureStack, certificates
from tests.integration.tiny_stack import tiny_stack

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from tests.figures import Figure

KEY, FILE_KEY = "k-3f9a2c", "k-from-the-file"
KEYS, CERTIFICATES, PLAINTEXT = 13, 14, 15
"""Their scenarios in the reliability report (scripts/reliability_scenarios.py)."""
SECRET = "zebra-quartz-7731"
"""A prompt marker that must appear in no span and no log line."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def stack(
    tiny_serving_dir: Path, certs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SecureStack]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# one key per line\n\n{FILE_KEY}\n")
    running = SecureStack(tiny_serving_dir, certs, keys, KEY)
    try:
        yield running
    finally:
        running.close()


def _client(stack: SecureStack, certs: dict[str, Path], key: str | None) -> StrataClient:
    return _client_of(stack.gateway.address, certs, key)


def _client_of(address: str, certs: dict[str, Path], key: str | None) -> StrataClient:
    return StrataClient(address, api_key=key, tls=ClientTlsSettings(ca_file=certs["ca"]), retry=NO_RETRY)


def test_a_client_with_a_key_is_served_over_tls_end_to_end(
    stack: SecureStack, certs: dict[str, Path], figure: Figure
) -> None:
    served = 0
    for key in (KEY, FILE_KEY):
        with _client(stack, certs, key) as client:
            response = client.generate("hello", timeout=30)
        served += response.usage.output_tokens == 4 and response.model == "tiny"
    figure(KEYS, "configured keys served all their tokens (settings, keys file)", served, "of 2")
    assert served == 2


def test_the_http_api_serves_https_with_the_same_certificate_and_keys(
    stack: SecureStack, certs: dict[str, Path]
) -> None:
    """The gateway's HTTP API speaks TLS with the gateway's `tls` (a client trusting the CA is served,
    a plaintext one is not) and wants the same API keys."""
    assert stack.gateway.http is not None
    url = f"https://{stack.gateway.http.address}/v1/completions"
    body = {"prompt": "hello", "max_tokens": 3}
    trusted = ssl.create_default_context(cafile=str(certs["ca"]))
    with httpx2.Client(verify=trusted, timeout=30) as https:
        reply = https.post(url, json=body, headers={"authorization": f"Bearer {KEY}"})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        assert https.post(url, json=body).status_code == 401
    with pytest.raises(httpx2.TransportError):
        httpx2.post(url.replace("https://", "http://"), json=body, timeout=10)


def test_every_http_route_but_readiness_wants_a_key(stack: SecureStack, certs: dict[str, Path]) -> None:
    """One middleware guards the HTTP API: each route answers 401 with the OpenAI error body without a
    key, and serves with one; GET /health answers without (probes carry no key)."""
    assert stack.gateway.http is not None
    base = f"https://{stack.gateway.http.address}"
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    requests = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", chat)]
    requests.append(("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2}))
    trusted = ssl.create_default_context(cafile=str(certs["ca"]))
    with httpx2.Client(verify=trusted, timeout=30) as https:
        for method, path, body in requests:
            refused = https.request(method, base + path, json=body)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["type"] == "authentication_error", path
            served = https.request(method, base + path, json=body, headers={"authorization": f"Bearer {KEY}"})
            assert served.status_code == 200, path
        assert https.get(base + "/health").status_code == 200


WRONG_KEYS: dict[str, tuple[str | None, str]] = {
    "none": (None, "no key"),
    "wrong": ("wrong", "a wrong key"),
    "key-plus-one": (KEY + "x", "a configured key plus one character"),
    "empty": ("", "an empty key"),
}
"""The keys a client may send that are not configured, by test id: (key, what it is)."""


@pytest.mark.parametrize("kind", list(WRONG_KEYS))
def test_a_missing_or_wrong_key_is_unauthenticated(
    stack: SecureStack, certs: dict[str, Path], kind: str, figure: Figure
) -> None:
    key, label = WRONG_KEYS[kind]
    with _client(stack, certs, key) as client, pytest.raises(grpc.RpcError) as error:
        client.generate("hello", timeout=30)
    code: grpc.StatusCode = error.value.code()  # type: ignore[attr-defined]
    figure(KEYS, label, code.name)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in error.value.details()  # type: ignore[attr-defined]


def _plaintext_health(address: str, service: str = "") -> str:
    """What a plaintext grpc.health.v1 Check of `address` gets: the status's name, or the error code's."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        except grpc.RpcError as error:
            return str(error.code().name)  # type: ignore[attr-defined]
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def test_health_needs_no_key_and_plaintext_reaches_nothing_but_the_health_ports(
    stack: SecureStack, certs: dict[str, Path], figure: Figure
) -> None:
    with grpc.secure_channel(
        stack.gateway.address, grpc.ssl_channel_credentials(certs["ca"].read_bytes())
    ) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    figure(PLAINTEXT, "gateway health over TLS with no key", status)
    main_ports = {"gateway": stack.gateway, "worker": stack.worker, "tokenizer": stack.tokenizer}
    plaintext = {name: _plaintext_health(server.address) for name, server in main_ports.items()}
    for name, answer in plaintext.items():
        figure(PLAINTEXT, f"plaintext to the {name}'s TLS port", answer)
    health_ports = {"worker": stack.worker, "tokenizer": stack.tokenizer}
    alive = {
        name: _plaintext_health(server.running.health_address, LIVENESS)
        for name, server in health_ports.items()
    }
    for name, answer in alive.items():
        figure(PLAINTEXT, f"plaintext liveness on the {name}'s health-only port", answer)
    assert status == "SERVING"
    assert plaintext == dict.fromkeys(main_ports, "UNAVAILABLE"), plaintext
    assert alive == dict.fromkeys(health_ports, "SERVING"), alive


IDENTITIES = {
    # test id: the client certificate presented
    "none": "no client certificate",
    "rogue": "a self-signed rogue certificate",
    "gateway": "the gateway's certificate from the CA",
}


@pytest.mark.parametrize("service", ["worker", "tokenizer"])
@pytest.mark.parametrize("identity", list(IDENTITIES))
def test_only_a_certificate_from_the_ca_reaches_the_internal_services(
    stack: SecureStack, certs: dict[str, Path], identity: str, service: str, figure: Figure
) -> None:
    pair: dict[str, Any] = {}
    if identity != "none":
        name = "client" if identity == "gateway" else "rogue"
        pair = {
            "certificate_chain": certs[name].read_bytes(),
            "private_key": certs[f"{name}-key"].read_bytes(),
        }
    credentials = grpc.ssl_channel_credentials(certs["ca"].read_bytes(), **pair)
    address = stack.worker.address if service == "worker" else stack.tokenizer.address
    with grpc.secure_channel(address, credentials) as channel:

        def call() -> str:
            if service == "worker":
                info = worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerInfo(
                    worker_pb2.GetWorkerInfoRequest(), timeout=10
                )
                return str(info.model)
            tokenizer = tokenizer_pb2_grpc.TokenizerServiceStub(channel).GetTokenizerInfo(
                tokenizer_pb2.GetTokenizerInfoRequest(), timeout=10
            )
            return str(tokenizer.models[0].name)

        try:
            answer = f"served (model {call()})"
        except grpc.RpcError as error:
            answer = str(error.code().name)  # type: ignore[attr-defined]
    figure(CERTIFICATES, f"{service} with {IDENTITIES[identity]}", answer)
    assert answer == ("served (model tiny)" if identity == "gateway" else "UNAVAILABLE")


def test_no_prompt_text_in_spans_or_logs_and_the_max_new_tokens_cap(
    stack: SecureStack, certs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    stack.spans.clear()
    with _client(stack, certs, KEY) as client:
        client.generate(f"tell me about {SECRET}", timeout=30)
        with pytest.raises(grpc.RpcError) as capped:
            client.generate(f"{SECRET} again", timeout=30, max_new_tokens=65)
    assert capped.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "max_new_tokens_limit" in capped.value.details()  # type: ignore[attr-defined]
    spans = stack.spans.get_finished_spans()
    assert spans, "the request was traced"
    for span in spans:
        assert SECRET not in span.name and SECRET not in repr(dict(span.attributes or {}))
    logged = [record.getMessage() + repr(getattr(record, "fields", "")) for record in caplog.records]
    assert any("request_finished" in line for line in logged)
    assert not any(SECRET in line for line in logged)


def test_bad_tls_settings_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as error:
        TokenizerSettings.build(
            {"models": {"m": "."}, "tls": {"cert_file": tmp_path / "no.pem", "key_file": tmp_path / "no"}}
        )
    assert "tokenizer.tls" in str(error.value) and "cannot read" in str(error.value)
    with pytest.raises(SettingsError) as half:
        GatewaySettings.build(
            {
                "tokenizer_address": "t:1",
                "routes": [{"model": "m", "workers": ["w:1"]}],
                "internal_tls": {"cert_file": tmp_path / "x"},
            }
        )
    assert "cert_file and key_file go together" in str(half.value)


def test_record_content_puts_the_text_in_the_span(tiny_serving_dir: Path) -> None:
    """Turned on in the settings, the prompt and completion are kept (and only then)."""

    async def main() -> dict[str, Any]:
        spans = InMemorySpanExporter()
        tracing = Tracing.with_exporter("g", spans, 1.0, batch=False)
        options = {"telemetry": {"record_content": True}}
        async with tiny_stack(tiny_serving_dir, gateway=options, gateway_tracing=tracing) as stack:
            address = stack.gateway.address
            await asyncio.to_thread(
                lambda: StrataClient(address).generate(SECRET, timeout=30, max_new_tokens=2)
            )
        [request] = [span for span in spans.get_finished_spans() if span.name.startswith("text_completion")]
        return dict(request.attributes or {})

    attributes = asyncio.run(main())
    assert attributes["gen_ai.prompt"] == SECRET and isinstance(attributes["gen_ai.completion"], str)


def test_the_cli_speaks_tls_with_a_key(stack: SecureStack, certs: dict[str, Path]) -> None:
    import sys

    base = [sys.executable, "-m", "strata.cli", "generate", "hi", "--address", stack.gateway.address]
    base += ["--tls-ca", str(certs["ca"]), "--max-new-tokens", "2"]
    keyed = [*base, "--api-key", KEY]
    served = subprocess.run(keyed, check=False, capture_output=True, text=True, timeout=120)
    assert served.returncode == 0, served.stderr
    clean = {"PATH": "/usr/bin"}  # no STRATA_API_KEY from this environment
    refused = subprocess.run(base, check=False, capture_output=True, text=True, timeout=120, env=clean)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr


def test_services_bind_to_loopback_unless_told_otherwise(tiny_serving_dir: Path) -> None:
    tokenizer = TokenizerSettings.build({"models": {"tiny": tiny_serving_dir}})
    worker = WorkerSettings.build({"model_name": "tiny", "model_path": tiny_serving_dir})
    gateway = GatewaySettings.build(
        {"tokenizer_address": "t:1", "routes": [{"model": "m", "workers": ["w:1"]}]}
    )
    for settings in (tokenizer, worker, gateway):
        assert settings.listen.startswith("127.0.0.1:"), settings.listen
        assert settings.telemetry.metrics_listen.startswith("127.0.0.1:")
        assert not settings.telemetry.record_content and settings.tls is None


def test_strata_up_starts_a_stack_with_tls_and_keys(
    tiny_serving_dir: Path, certs: dict[str, Path], tmp_path: Path
) -> None:
    """The launcher probes each service's plaintext health port, since the main ports want TLS, and
    reports where each one is."""
    server = {"cert_file": str(certs["server"]), "key_file": str(certs["server-key"])}
    mutual = {**server, "client_ca_file": str(certs["ca"])}
    internal = {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "tls": mutual}
    config = {
        "tokenizer": {**internal, "models": {"tiny": str(tiny_serving_dir)}},
        "workers": [{**internal, "model_name": "tiny", "model_path": str(tiny_serving_dir), "threads": 1}],
        "gateway": {
            "listen": "127.0.0.1:0",
            "health_listen": "127.0.0.1:0",
            "tls": server,
            "internal_tls": {
                "ca_file": str(certs["ca"]),
                "cert_file": str(certs["client"]),
                "key_file": str(certs["client-key"]),
            },
            "api_keys": [KEY],
        },
    }
    path = tmp_path / "secure.yaml"
    path.write_text(yaml.safe_dump(config))
    with (
        start_stack(path, log_dir=tmp_path / "logs") as stack,
        _client_of(stack.addresses.gateway, certs, KEY) as client,
    ):
        assert client.generate("hello", timeout=60, max_new_tokens=3).usage.output_tokens == 3
        health_ports = stack.health_addresses  # announced by each child, OS-chosen ports
        assert sorted(health_ports) == ["gateway", "tokenizer", "worker 0"], health_ports
        assert {_plaintext_health(address) for address in health_ports.values()} == {"SERVING"}
