"""docker-compose.yml and the Kubernetes manifests describe one deployment: the same images, ports,
health checks and worker memory limits. Compose runs for real (`make compose-test`); no cluster runs
here, so the manifests are held to the compose file that does. Both are read statically (the CPU
overlay rendered with `kubectl kustomize`); no containers, no cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s_manifests import Obj, container_port, containers, named, render

ROOT = Path(__file__).resolve().parents[2]
# compose service -> the Kubernetes Deployment that runs it
SERVICES = {
    "tokenizer": "strata-tokenizer",
    "worker": "strata-worker-primary",
    "worker-fallback": "strata-worker-fallback",
    "gateway": "strata-gateway",
}
GIB = 2**30


def _compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return dict(data["services"])


def _settings(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def cpu() -> list[Obj]:
    return render("cpu")


def _bytes(quantity: str) -> int:
    units = {"g": GIB, "Gi": GIB, "m": 2**20, "Mi": 2**20}
    for suffix, size in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * size)
    return int(quantity)


def _ports(settings: dict[str, Any], service: str) -> set[int]:
    """The ports a service's settings listen on, from the settings file it reads."""
    if service.startswith("worker"):
        section = settings["workers"][0 if service == "worker" else 1]
    else:
        section = settings[service]
    keys = ("listen", "http_listen", "health_listen")
    found = {int(str(section[key]).rpartition(":")[2]) for key in keys if section.get(key)}
    return found | {int(str(settings["telemetry"]["metrics_listen"]).rpartition(":")[2])}


@pytest.mark.parametrize("service", SERVICES)
def test_both_run_the_same_image_and_command(cpu: list[Obj], service: str) -> None:
    compose = _compose()[service]
    [container] = containers(named(cpu, "Deployment", SERVICES[service]), init=False)
    assert container["image"] == compose["image"]
    assert container["command"] == compose["command"]


@pytest.mark.parametrize("service", SERVICES)
def test_both_listen_on_the_same_ports(cpu: list[Obj], service: str) -> None:
    compose_ports = _ports(_settings(ROOT / "configs" / "compose.yaml"), service)
    k8s_ports = _ports(_settings(ROOT / "deploy" / "k8s" / "base" / "strata.yaml"), service)
    assert compose_ports == k8s_ports
    [container] = containers(named(cpu, "Deployment", SERVICES[service]), init=False)
    declared = {int(port["containerPort"]) for port in container["ports"]}
    assert declared == k8s_ports, (
        f"{SERVICES[service]} declares {declared}, its settings listen on {k8s_ports}"
    )
    for published in _compose()[service].get("ports", []):
        assert container_port(container, int(str(published).rpartition(":")[2])) is not None, published


@pytest.mark.parametrize("service", SERVICES)
def test_both_probe_readiness_on_the_health_port(cpu: list[Obj], service: str) -> None:
    """Compose's check is readiness (the empty service name) through strata.probe on 8081; the
    kubelet's readiness probe asks the same port for the same service, its liveness for `liveness`."""
    check = _compose()[service]["healthcheck"]["test"]
    assert check[:5] == ["CMD", "python", "-m", "strata.probe", "127.0.0.1:8081"]
    assert check[5:] == ["--service", ""]
    [container] = containers(named(cpu, "Deployment", SERVICES[service]), init=False)
    readiness = container["readinessProbe"]["grpc"]
    assert readiness["port"] == 8081 and readiness.get("service", "") == ""
    assert container["livenessProbe"]["grpc"] == {"port": 8081, "service": "liveness"}


@pytest.mark.parametrize("service", ["worker", "worker-fallback"])
def test_a_worker_has_the_same_memory_limit_in_both(cpu: list[Obj], service: str) -> None:
    """A worker sizes its KV cache from its cgroup's limit: one limit, one cache size, either way."""
    limit = _compose()[service]["mem_limit"]
    [container] = containers(named(cpu, "Deployment", SERVICES[service]), init=False)
    assert _bytes(container["resources"]["limits"]["memory"]) == _bytes(limit)
