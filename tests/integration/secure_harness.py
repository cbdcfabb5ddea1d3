"""The TLS tests' stack and certificates: made at test time with the openssl command, a CA, a server
certificate, a gateway client certificate and a rogue one, and the three services in-process with TLS
on every hop. It holds no test and no assertion about security (test_security.py does). The route
carries tests/route_defaults.py's NO_SLO_ROUTE: no refusal for the machine's speed.
"""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.server import start as start_gateway
from gateway.settings import GatewaySettings
from services.tokenizer.server import start as start_tokenizer
from services.tokenizer.settings import TokenizerSettings
from services.worker.server import start as start_worker
from services.worker.settings import WorkerSettings
from strata.tracing import Tracing
from tests.integration.loop_thread import LoopThread
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from pathlib import Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _self_signed(subject: str, key: Path, cert: Path) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", subject,
             "-keyout", str(key), "-out", str(cert))  # fmt: skip


def certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a gateway client certificate signed
    by it, and a rogue one signed by nobody the services trust, in `directory`."""
    names = ("ca", "ca-key", "server", "server-key", "client", "client-key", "rogue", "rogue-key")
    paths = {name: directory / f"{name}.pem" for name in names}
    _self_signed("/CN=strata-test-ca", paths["ca-key"], paths["ca"])
    san = directory / "san.cnf"
    san.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, subject in (("server", "/CN=localhost"), ("client", "/CN=strata-gateway")):
        request = directory / f"{name}.csr"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
                 "-keyout", str(paths[f"{name}-key"]), "-out", str(request))  # fmt: skip
        _openssl("x509", "-req", "-in", str(request), "-CA", str(paths["ca"]), "-CAkey", str(paths["ca-key"]),
                 "-CAcreateserial", "-days", "2", "-extfile", str(san), "-out", str(paths[name]))  # fmt: skip
    # Signed by nobody the services trust.
    _self_signed("/CN=rogue", paths["rogue-key"], paths["rogue"])
    return paths


class SecureStack:
    """The tokenizer service and a worker demanding client certificates from the CA, and a gateway
    speaking TLS to clients (gRPC and HTTP), mutual TLS to them, and wanting `key` or a key of
    `keys_file`. Every span goes to `spans`."""

    def __init__(self, model_dir: Path, certs: dict[str, Path], keys_file: Path, key: str) -> None:
        self.loop = LoopThread()
        self.spans = InMemorySpanExporter()
        server_tls = {"cert_file": certs["server"], "key_file": certs["server-key"]}
        mutual = {**server_tls, "client_ca_file": certs["ca"]}
        common = {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "tls": mutual}
        tracing = {
            name: Tracing.with_exporter(name, self.spans, 1.0, batch=False) for name in ("g", "t", "w")
        }
        self.tokenizer = self.loop.run(
            start_tokenizer(
                TokenizerSettings.build({**common, "models": {"tiny": model_dir}}), tracing=tracing["t"]
            )
        )
        self.worker = self.loop.run(
            start_worker(
                WorkerSettings.build(
                    {**common, "model_name": "tiny", "model_path": model_dir, "device": "cpu", "threads": 1}
                ),
                tracing=tracing["w"],
            )
        )
        self.loop.run(self.worker.wait_ready())
        self.gateway = self.loop.run(
            start_gateway(
                GatewaySettings.build(
                    {
                        "listen": "127.0.0.1:0",
                        "http_listen": "127.0.0.1:0",
                        "tls": server_tls,
                        "tokenizer_address": self.tokenizer.address,
                        "routes": [harness_route("tiny", workers=[self.worker.address])],
                        "internal_tls": {
                            "ca_file": certs["ca"],
                            "cert_file": certs["client"],
                            "key_file": certs["client-key"],
                        },
                        "api_keys": [key],
                        "api_keys_file": keys_file,
                        "default_max_new_tokens": 4,
                        "max_new_tokens_limit": 64,
                    }
                ),
                tracing=tracing["g"],
            )
        )
        assert self.loop.run(self.gateway.wait_ready(60)), "the gateway never linked over mutual TLS"

    def close(self) -> None:
        self.loop.run(self.gateway.stop(0))
        self.loop.run(self.worker.stop(grace=0))
        self.loop.run(self.tokenizer.stop(grace=0))
        self.loop.close()
