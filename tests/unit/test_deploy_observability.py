"""Static checks of the observability deployment files under deploy/ (collector, Prometheus, Grafana,
observability-compose.yaml), which cannot be run here (no Docker engine).

The dashboard's queries are checked against the metrics the services really declare: the gateway,
worker and tokenizer metric modules are imported and their families read from the default registry,
plus the gauges a gateway RouterCollector yields at scrape time. No network, no containers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COLLECTOR = DEPLOY / "otel" / "collector.yaml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
PROMETHEUS_HOST = DEPLOY / "prometheus" / "prometheus-host.yml"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "strata.json"
COMPOSE = DEPLOY / "observability-compose.yaml"
JOBS = {"gateway", "tokenizer", "worker", "worker-fallback"}
COMPONENT_KINDS = ("receivers", "processors", "exporters")


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a mapping"
    return data


def load_dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def declared_metric_names() -> set[str]:
    """Every strata_* metric the services declare, as PromQL names it (counters with _total)."""
    import gateway.metrics
    import services.tokenizer.metrics
    import services.worker.metrics  # noqa: F401  (imported to register its metrics)

    router = gateway.metrics.RouterCollector()
    router.add(lambda: [("m", 1, 2)])
    families = [*REGISTRY.collect(), *router.collect()]
    names: set[str] = set()
    for family in families:
        if family.name.startswith("strata_"):
            # A counter's family drops the _total its only exposed series carries.
            names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [str(t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable["query"]
        exprs.append(str(query["query"] if isinstance(query, dict) else query))
    return exprs


def test_every_yaml_and_json_file_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml")) + sorted(DEPLOY.rglob("*.json"))
    mine = [f for f in files if f.relative_to(DEPLOY).parts[0] in {"otel", "prometheus", "grafana"}]
    assert len(mine) >= 6, mine
    for path in files:
        data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        assert isinstance(data, dict) and data, f"{path} is empty or not a mapping"


def test_collector_pipelines_reference_only_defined_components() -> None:
    config = load_yaml(COLLECTOR)
    service = config["service"]
    assert set(service["extensions"]) <= set(config["extensions"])
    assert "health_check" in service["extensions"]
    pipelines = service["pipelines"]
    assert "traces" in pipelines
    used: dict[str, set[str]] = {kind: set() for kind in COMPONENT_KINDS}
    for name, pipeline in pipelines.items():
        for kind in COMPONENT_KINDS:
            refs = pipeline.get(kind, [])
            assert set(refs) <= set(config[kind]), f"pipeline {name} names undefined {kind}: {refs}"
            used[kind] |= set(refs)
        assert pipeline["processors"][0] == "memory_limiter", "memory_limiter must come first"
    for kind in COMPONENT_KINDS:
        assert used[kind] == set(config[kind]), f"{kind} defined but unused"


def test_collector_receives_otlp_and_exports_to_jaeger() -> None:
    config = load_yaml(COLLECTOR)
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    jaeger = [e for name, e in config["exporters"].items() if name.split("/")[0] == "otlp"]
    assert len(jaeger) == 1
    assert jaeger[0]["endpoint"] == "jaeger:4317" and jaeger[0]["tls"]["insecure"] is True
    assert "debug" in config["exporters"]
    assert {"batch", "memory_limiter"} <= set(config["processors"])


def scrape_targets(path: Path) -> dict[str, list[str]]:
    config = load_yaml(path)
    assert config["global"]["scrape_interval"] == "5s"
    targets: dict[str, list[str]] = {}
    for job in config["scrape_configs"]:
        relabel = job["relabel_configs"]
        assert {"source_labels": ["job"], "target_label": "service"} in relabel
        static = [t for entry in job.get("static_configs", []) for t in entry["targets"]]
        by_dns = [
            f"{name}:{entry['port']}" for entry in job.get("dns_sd_configs", []) for name in entry["names"]
        ]
        targets[job["job_name"]] = static + by_dns
    return targets


def test_prometheus_scrapes_each_service_on_port_9464() -> None:
    targets = scrape_targets(PROMETHEUS)
    assert set(targets) == JOBS
    for job, addresses in targets.items():
        assert addresses == [f"{job}:9464"]


def test_prometheus_host_scrapes_distinct_host_ports_documented_in_readme() -> None:
    targets = scrape_targets(PROMETHEUS_HOST)
    assert set(targets) == JOBS
    addresses = [address for job in sorted(targets) for address in targets[job]]
    assert len(addresses) == len(JOBS) == len(set(addresses))
    readme = (DEPLOY / "README.md").read_text()
    for address in addresses:
        host, _, port = address.rpartition(":")
        assert host == "host.docker.internal" and port.isdigit()
        assert f"`{address}`" in readme, f"README does not document {address}"


def test_grafana_datasources_and_dashboard_provider() -> None:
    sources = {s["uid"]: s for s in load_yaml(DATASOURCES)["datasources"]}
    assert sources["prometheus"]["type"] == "prometheus"
    assert sources["prometheus"]["url"] == "http://prometheus:9090"
    assert sources["jaeger"]["type"] == "jaeger"
    assert sources["jaeger"]["url"] == "http://jaeger:16686"
    (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_dashboard_panels_each_have_prometheus_datasource_and_target() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "strata" and dashboard["schemaVersion"] >= 39
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "prometheus", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "prometheus", panel["title"]
            assert 'model=~"$model"' in target["expr"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
    (variable,) = dashboard["templating"]["list"]
    assert variable["name"] == "model"
    assert variable["definition"] == "label_values(strata_request_duration_seconds_count, model)"


def test_dashboard_queries_only_metrics_the_services_declare() -> None:
    declared = declared_metric_names()
    assert {"strata_gateway_queued_requests", "strata_gateway_requests_in_flight"} <= declared
    used: set[str] = set()
    for expr in dashboard_exprs(load_dashboard()):
        for name in re.findall(r"strata_[a-z_]+", expr):
            used.add(re.sub(r"_(bucket|sum|count)$", "", name))
    assert len(used) >= 20
    assert used <= declared, f"not declared by any service: {sorted(used - declared)}"


def test_dashboard_breaks_latency_down_by_every_stage() -> None:
    from gateway.stage_clock import STAGES

    (panel,) = [p for p in load_dashboard()["panels"] if p["title"] == "Latency breakdown by stage"]
    assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert "by (stage)" in panel["targets"][0]["expr"]
    for stage in STAGES:
        assert stage in panel["description"], stage


def compose_services() -> dict[str, Any]:
    services = load_yaml(COMPOSE)["services"]
    assert isinstance(services, dict)
    return services


def test_compose_mounts_files_that_exist() -> None:
    mounts = 0
    for name, service in compose_services().items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            assert source.startswith("./"), f"{name}: {volume} is not a repository path"
            assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
            mounts += 1
    assert mounts >= 4


@pytest.mark.parametrize("name", ["otel-collector", "jaeger", "prometheus", "grafana"])
def test_compose_service_image_is_pinned(name: str) -> None:
    image = compose_services()[name]["image"]
    repository, _, tag = image.rpartition(":")
    assert repository and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), image


def test_compose_wires_configs_ports_and_host_gateway() -> None:
    services = compose_services()
    published = {str(p).rsplit(":", 1)[-1] for s in services.values() for p in s.get("ports", [])}
    assert {"16686", "9090", "3000", "4317"} <= published
    collector = services["otel-collector"]
    (config_flag,) = collector["command"]
    mounted = {str(v).split(":")[1]: str(v).split(":")[0] for v in collector["volumes"]}
    assert mounted[config_flag.removeprefix("--config=")] == "./otel/collector.yaml"
    prometheus = services["prometheus"]
    assert "./prometheus/prometheus-host.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "host.docker.internal:host-gateway" in prometheus["extra_hosts"]
    grafana_targets = {str(v).split(":")[1] for v in services["grafana"]["volumes"]}
    assert {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"} <= grafana_targets
