"""Static checks of the compose deployment: docker-compose.yml, the GPU override
docker-compose.gpu.yml and the stack's settings configs/compose.yaml, which cannot be run here (no
Docker engine).

Both files, and the override merged onto the base by compose's merge rules, are validated against
the compose specification (check-jsonschema's vendored schema). The rest checks what a schema cannot
see: only the gateway and the UIs are published, health checks and depends_on conditions hold
together, mounted files exist, the settings load with the services' own models and name compose
services, and the override gives a GPU to exactly the two workers. No containers, no network.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.settings import GatewaySettings
from services.tokenizer.settings import TokenizerSettings
from services.worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "docker-compose.yml"
GPU = ROOT / "docker-compose.gpu.yml"
SETTINGS = ROOT / "configs" / "compose.yaml"
CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"
CONFIG_MOUNT = "./configs/compose.yaml:/etc/strata/strata.yaml:ro"
STRATA = {"tokenizer", "worker", "worker-fallback", "gateway"}
PUBLISHED = {
    "gateway": ["50051:50051", "8000:8000"],
    "jaeger": ["127.0.0.1:16686:16686"],
    "prometheus": ["127.0.0.1:9090:9090"],
    "grafana": ["127.0.0.1:3000:3000"],
}
# One-shot (fetch-model), or an image with no shell nor HTTP client to run a check (the collector).
NO_HEALTHCHECK = {"fetch-model", "otel-collector"}
# Compose's merge rules: these sequences are replaced by the override's; others are concatenated
# without duplicates (mappings are merged key by key).
REPLACED_SEQUENCES = {"command", "entrypoint", "test"}


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a mapping"
    return data


def merge(base: Any, override: Any, key: str = "") -> Any:
    """`override` merged onto `base` as `docker compose -f base -f override` does."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = copy.deepcopy(base)
        for name, value in override.items():
            merged[name] = merge(base[name], value, name) if name in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(override, list) and key not in REPLACED_SEQUENCES:
        return copy.deepcopy(base) + [item for item in override if item not in base]
    return copy.deepcopy(override)


def merged() -> dict[str, Any]:
    result = merge(load(BASE), load(GPU))
    assert isinstance(result, dict)
    return result


def check_compose_schema(path: Path) -> None:
    assert CHECK_JSONSCHEMA.is_file(), f"{CHECK_JSONSCHEMA} is missing: install the dev extra"
    result = subprocess.run(
        [str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def gpu_services(compose: dict[str, Any]) -> set[str]:
    names = set()
    for name, service in compose["services"].items():
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices):
            names.add(name)
    return names


def worker_index(service: dict[str, Any]) -> int:
    command = service["command"]
    return int(command[command.index("--index") + 1])


def test_the_base_file_follows_the_compose_specification() -> None:
    check_compose_schema(BASE)


def test_the_gpu_override_merged_onto_the_base_follows_the_compose_specification(tmp_path: Path) -> None:
    check_compose_schema(GPU)
    path = tmp_path / "docker-compose.merged.yml"
    path.write_text(yaml.safe_dump(merged(), sort_keys=False))
    check_compose_schema(path)


def test_the_merge_follows_compose_rules() -> None:
    base = {"s": {"command": ["a"], "ports": ["1:1"], "environment": {"A": "1"}, "build": {"target": "x"}}}
    override = {
        "s": {"command": ["b"], "ports": ["2:2"], "environment": {"B": "2"}, "build": {"target": "y"}}
    }
    assert merge(base, override) == {
        "s": {
            "command": ["b"],
            "ports": ["1:1", "2:2"],
            "environment": {"A": "1", "B": "2"},
            "build": {"target": "y"},
        }
    }
    assert base["s"]["ports"] == ["1:1"], "the merge must not change its inputs"


@pytest.mark.parametrize("which", ["base", "gpu"])
def test_only_the_gateway_and_the_uis_are_published(which: str) -> None:
    compose = load(BASE) if which == "base" else merged()
    published = {name: s["ports"] for name, s in compose["services"].items() if s.get("ports")}
    assert published == PUBLISHED
    assert not any("expose" in s or s.get("network_mode") == "host" for s in compose["services"].values())


def test_every_long_running_service_has_a_health_check_and_a_restart_policy() -> None:
    services = load(BASE)["services"]
    assert set(services) == STRATA | {"fetch-model", "otel-collector", "jaeger", "prometheus", "grafana"}
    for name, service in services.items():
        check = service.get("healthcheck", {})
        if name in NO_HEALTHCHECK:
            assert check in ({}, {"disable": True}), name
        else:
            assert check.get("test") and not check.get("disable"), f"{name} has no health check"
        assert service["restart"] == ("no" if name == "fetch-model" else "unless-stopped"), name
    for name in STRATA:
        test = services[name]["healthcheck"]["test"]
        # Readiness (""), so that service_healthy means the model is loaded and the links are up.
        assert test == ["CMD", "python", "-m", "strata.probe", "127.0.0.1:8081", "--service", ""], name
    for name in ("worker", "worker-fallback"):
        period = services[name]["healthcheck"]["start_period"]
        assert int(period.removesuffix("s")) >= 120, f"{name}: {period} is too short for a model load"


def test_depends_on_conditions_name_existing_services_and_hold_together() -> None:
    services = load(BASE)["services"]
    conditions = {"service_started", "service_healthy", "service_completed_successfully"}
    for name, service in services.items():
        for dependency, spec in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            assert spec["condition"] in conditions
            if spec["condition"] == "service_healthy":
                assert dependency not in NO_HEALTHCHECK, f"{dependency} has no health check to wait for"
    gateway = services["gateway"]["depends_on"]
    for name in ("tokenizer", "worker", "worker-fallback"):
        assert gateway[name]["condition"] == "service_healthy"
        assert services[name]["depends_on"]["fetch-model"]["condition"] == "service_completed_successfully"

    def reaches(start: str, seen: tuple[str, ...]) -> None:
        for dependency in services[start].get("depends_on", {}):
            assert dependency not in seen, f"depends_on cycle: {[*seen, dependency]}"
            reaches(dependency, (*seen, dependency))

    for name in services:
        reaches(name, (name,))


def test_mounted_files_exist_and_the_strata_services_share_one_settings_file() -> None:
    services = load(BASE)["services"]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source == "models", f"{name} mounts an unknown volume {source}"
    for name in STRATA:
        volumes = services[name]["volumes"]
        assert CONFIG_MOUNT in volumes, name
        assert [v for v in volumes if "/etc/strata" in v] == [CONFIG_MOUNT], name
        assert (
            "--config" in services[name]["command"] and "/etc/strata/strata.yaml" in services[name]["command"]
        )
    assert "models:/models" in services["fetch-model"]["volumes"]
    for name in STRATA - {"gateway"}:
        assert "models:/models:ro" in services[name]["volumes"], name


@pytest.mark.parametrize("which", ["base", "gpu"])
def test_builds_name_existing_dockerfiles_and_targets_and_images_are_pinned(which: str) -> None:
    compose = load(BASE) if which == "base" else merged()
    for name, service in compose["services"].items():
        image = service["image"]
        assert re.search(r":v?\d+\.\d+\.\d+$", image), f"{name}: image {image} is not pinned"
        if "build" not in service:
            continue
        build = service["build"]
        dockerfile = ROOT / build["context"] / build["dockerfile"]
        assert dockerfile.is_file(), f"{name} builds {dockerfile}, which does not exist"
        stages = re.findall(r"^FROM \S+ AS (\S+)$", dockerfile.read_text(), re.MULTILINE)
        assert build.get("target", stages[-1]) in stages, f"{name}: no stage {build.get('target')}"
        assert image.split(":")[0].endswith(build.get("target", "services")), f"{name}: {image} vs {build}"
    observability = load(ROOT / "deploy" / "observability-compose.yaml")["services"]
    for name, service in observability.items():
        assert compose["services"][name]["image"] == service["image"], (
            f"{name}: keep the two files' tags equal"
        )


def test_the_settings_load_and_name_compose_services() -> None:
    services = load(BASE)["services"]
    tokenizer = TokenizerSettings.load(SETTINGS)
    workers = {
        name: WorkerSettings.load(SETTINGS, index=worker_index(services[name]))
        for name in ("worker", "worker-fallback")
    }
    gateway = GatewaySettings.load(SETTINGS)
    assert worker_index(services["worker"]) == 0 and worker_index(services["worker-fallback"]) == 1
    everyone = [tokenizer, gateway, *workers.values()]
    for settings in everyone:
        assert settings.health_listen == "0.0.0.0:8081"
        assert settings.telemetry.metrics_listen == "0.0.0.0:9464"
        assert settings.telemetry.tracing == "on"
        host = settings.telemetry.otlp_endpoint.removeprefix("http://").split(":")[0]
        assert host in services
    assert tokenizer.listen == "0.0.0.0:50052" and gateway.listen == "0.0.0.0:50051"
    assert gateway.tokenizer_address == "tokenizer:50052"
    for name, worker in workers.items():
        assert worker.listen == "0.0.0.0:50053"
        assert str(worker.model_path).startswith("/models/")
        assert tokenizer.models[worker.model_name] == worker.model_path
        route = next(r for r in gateway.routes if r.model == worker.model_name)
        assert route.dns == f"{name}:50053", f"route {route.model} must find the {name} containers"
    primary = next(r for r in gateway.routes if r.model == workers["worker"].model_name)
    assert primary.fallback == workers["worker-fallback"].model_name
    assert gateway.default_model == primary.model


def test_prometheus_scrapes_the_compose_services_on_the_metrics_port() -> None:
    services = load(BASE)["services"]
    config = load(ROOT / "deploy" / "prometheus" / "prometheus.yml")
    targets = [
        f"{name}:{entry['port']}"
        for job in config["scrape_configs"]
        for entry in job["dns_sd_configs"]
        for name in entry["names"]
    ]
    assert {t.split(":")[0] for t in targets} == STRATA
    assert all(t.endswith(":9464") and t.split(":")[0] in services for t in targets)


def test_the_gpu_override_gives_a_gpu_to_exactly_the_two_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = merged()
    assert gpu_services(load(BASE)) == set()
    assert gpu_services(compose) == {"worker", "worker-fallback"}
    for name in ("worker", "worker-fallback"):
        service = compose["services"][name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert service["build"]["target"] == "cuda" and service["image"].startswith("strata/worker-cuda:")
        assert service["command"] == load(BASE)["services"][name]["command"], "the override keeps the command"
        environment = service["environment"]
        for variable in environment:
            field = variable.removeprefix("STRATA_WORKER_").lower()
            assert variable.startswith("STRATA_WORKER_") and field in WorkerSettings.model_fields, variable
        for variable, value in environment.items():
            monkeypatch.setenv(variable, value)
        worker = WorkerSettings.load(SETTINGS, index=worker_index(service))
        for variable in environment:
            monkeypatch.delenv(variable)
        assert worker.device == "cuda"
        assert worker.quantization == ("nf4" if name == "worker-fallback" else "none")
