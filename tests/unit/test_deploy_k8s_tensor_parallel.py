"""Static checks of the two tensor-parallel overlays of deploy/k8s (no cluster here, nor in CI).

`gpu-tp` gives the primary worker two GPUs in one pod (rank 0 starts rank 1 in its container);
`gpu-lws` makes it a LeaderWorkerSet of two pods (the leader rank 0 with the Service, the worker pod
rank 1). Both are rendered with `kubectl kustomize`; every object Kubernetes itself defines is
validated against its API schemas in strict mode, and the LeaderWorkerSet's two pod templates are
validated as Pods (the LeaderWorkerSet kind is a custom resource the schemas do not carry). The rest
is what a schema cannot see: the settings each worker container loads, GPUs, labels the Service
selects, the rank variables, the settings ConfigMap's generated name and the namespace.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import kubernetes_validate
import pytest

from services.worker.settings import WorkerSettings
from tests.k8s_manifests import (
    KUBERNETES_VERSION,
    Obj,
    containers,
    load_as,
    named,
    of_kind,
    render,
    selects,
    settings_file,
)

if TYPE_CHECKING:
    from pathlib import Path

LWS = "LeaderWorkerSet"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {overlay: render(overlay) for overlay in ("gpu-tp", "gpu-lws")}


@pytest.fixture(autouse=True)
def _no_strata_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith(("STRATA_", "OTEL_"))]:
        monkeypatch.delenv(name)


def as_pod(template: Obj, name: str) -> Obj:
    """A pod template as the Pod it makes, for the schema."""
    metadata = {"name": name, "namespace": "strata", **template["metadata"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


@pytest.mark.parametrize("overlay", ["gpu-tp", "gpu-lws"])
def test_every_object_is_valid_against_the_api(rendered: dict[str, list[Obj]], overlay: str) -> None:
    """Strict schema validation of every built-in object, and of the LeaderWorkerSet's pod templates."""
    for obj in rendered[overlay]:
        if obj["kind"] == LWS:
            template = obj["spec"]["leaderWorkerTemplate"]
            for part in ("leaderTemplate", "workerTemplate"):
                pod = as_pod(template[part], part.lower())
                assert (
                    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
                )
        else:
            assert kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "strata", obj["metadata"]


def test_gpu_tp_gives_the_primary_two_ranks_on_two_gpus(
    rendered: dict[str, list[Obj]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = rendered["gpu-tp"]
    path = settings_file(objs, tmp_path)
    primary_deployment = named(objs, "Deployment", "strata-worker-primary")
    primary = load_as(primary_deployment, path, monkeypatch)
    fallback = load_as(named(objs, "Deployment", "strata-worker-fallback"), path, monkeypatch)
    assert isinstance(primary, WorkerSettings) and isinstance(fallback, WorkerSettings)
    assert (primary.tensor_parallel_size, primary.device) == (2, "cuda")
    assert fallback.tensor_parallel_size == 1
    [worker] = containers(primary_deployment, init=False)
    assert (
        worker["resources"]["limits"]["nvidia.com/gpu"]
        == worker["resources"]["requests"]["nvidia.com/gpu"]
        == 2
    )
    volumes = {v["name"]: v for v in primary_deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]


def test_gpu_lws_runs_the_primary_as_a_leader_and_a_worker_pod(
    rendered: dict[str, list[Obj]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader alone serves (the Service selects it, it has the gRPC and health ports and probes),
    the group is as large as the settings' tensor_parallel_size and restarts as one, each pod maps
    LeaderWorkerSet's variables to torch.distributed's, and mounts the generated settings ConfigMap."""
    objs = rendered["gpu-lws"]
    assert not [d for d in of_kind(objs, "Deployment") if d["metadata"]["name"] == "strata-worker-primary"]
    [lws] = of_kind(objs, LWS)
    group = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    service = named(objs, "Service", "strata-worker-primary")
    assert selects(service["spec"]["selector"], leader["metadata"]["labels"])
    assert not selects(service["spec"]["selector"], worker["metadata"]["labels"])
    [config_map] = of_kind(objs, "ConfigMap")
    path = settings_file(objs, tmp_path)
    for template in (leader, worker):
        [container] = template["spec"]["containers"]
        script = container["command"][-1]
        for mapping in (
            'MASTER_ADDR="$LWS_LEADER_ADDRESS"',
            'WORLD_SIZE="$LWS_GROUP_SIZE"',
            'RANK="$LWS_WORKER_INDEX"',
        ):
            assert mapping in script
        assert script.endswith("exec python -m services.worker --config /etc/strata/strata.yaml --index 0")
        with monkeypatch.context() as patch:
            for entry in container["env"]:
                patch.setenv(entry["name"], entry["value"])
            settings = WorkerSettings.load(path, index=0)
        assert settings.tensor_parallel_size == group["size"] == 2
        assert settings.device == "cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    leader_ports = {p["name"] for p in leader["spec"]["containers"][0]["ports"]}
    assert {"grpc", "health", "rendezvous"} <= leader_ports
    assert "readinessProbe" in leader["spec"]["containers"][0]
    assert "ports" not in worker["spec"]["containers"][0]
    policy = named(objs, "NetworkPolicy", "strata-worker-primary-ranks")
    own = {"leaderworkerset.sigs.k8s.io/name": "strata-worker-primary"}
    assert policy["spec"]["podSelector"]["matchLabels"] == own
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": own}}]}]
