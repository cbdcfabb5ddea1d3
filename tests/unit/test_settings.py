"""Settings: YAML sections, STRATA_* overrides, relative paths, and errors that name the value and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from gateway.settings import GatewaySettings
from services.tokenizer.settings import TokenizerSettings
from services.worker.settings import WorkerSettings
from strata.settings import DEFAULT_CONFIG, SettingsError

if TYPE_CHECKING:
    from pathlib import Path

CONFIG = """
tokenizer:
  listen: 127.0.0.1:0
  models: {tiny: ../models/tiny}
workers:
  - {model_name: tiny, model_path: ../models/tiny, engine: {max_num_seqs: 8}}
  - {model_name: tiny, model_path: /abs/tiny, listen: "127.0.0.1:7001"}
gateway:
  listen: 127.0.0.1:0
  tokenizer_address: 127.0.0.1:7000
  routes: [{model: tiny, workers: ["127.0.0.1:7001"]}]
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "conf" / "stack.yaml"
    path.parent.mkdir()
    path.write_text(CONFIG)
    return path


def test_sections_load_and_relative_paths_follow_the_file(config: Path) -> None:
    tokenizer = TokenizerSettings.load(config)
    assert tokenizer.models["tiny"] == (config.parent / "../models/tiny").resolve()
    first = WorkerSettings.load(config, index=0)
    assert first.model_path == (config.parent / "../models/tiny").resolve()
    assert first.engine.max_num_seqs == 8 and first.credit_limit == 16
    assert str(WorkerSettings.load(config, index=1).model_path) == "/abs/tiny"
    gateway = GatewaySettings.load(config)
    assert gateway.default_route == "tiny" and gateway.routes[0].workers == ("127.0.0.1:7001",)


def test_environment_overrides_the_file(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_WORKER_ENGINE__MAX_NUM_SEQS", "3")
    monkeypatch.setenv("STRATA_WORKER_LISTEN", "127.0.0.1:9")
    monkeypatch.setenv("STRATA_GATEWAY_ROUTES", '[{"model": "tiny", "workers": ["a:1", "b:2"]}]')
    worker = WorkerSettings.load(config, index=0)
    assert worker.engine.max_num_seqs == 3 and worker.listen == "127.0.0.1:9"
    assert worker.model_name == "tiny"  # untouched fields keep the file's value
    assert GatewaySettings.load(config).routes[0].workers == ("a:1", "b:2")


def test_errors_name_the_value_and_the_fix(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_WORKER_ENGINE__MAX_NUM_SEQS", "-3")
    with pytest.raises(SettingsError) as bad_engine:
        WorkerSettings.load(config, index=0)
    assert "max_num_seqs" in str(bad_engine.value) and "-3" in str(bad_engine.value)
    assert "STRATA_WORKER_ENGINE__MAX_NUM_SEQS" in str(bad_engine.value)
    with pytest.raises(SettingsError, match="index 5 does not exist"):
        WorkerSettings.load(config, index=5)
    monkeypatch.setenv("STRATA_GATEWAY_DEFAULT_MODEL", "nope")
    with pytest.raises(SettingsError, match=r"default_model='nope' is not among the routes"):
        GatewaySettings.load(config)


def test_missing_fields_and_files_are_explained(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("gateway: {listen: '127.0.0.1:0'}\n")
    with pytest.raises(SettingsError) as missing:
        GatewaySettings.load(empty)
    assert "gateway.tokenizer_address: Field required" in str(missing.value)
    assert "STRATA_GATEWAY_TOKENIZER_ADDRESS" in str(missing.value)
    with pytest.raises(SettingsError, match="does not exist"):
        GatewaySettings.load(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("gateway: [unclosed\n")
    with pytest.raises(SettingsError, match="not valid YAML"):
        GatewaySettings.load(broken)


def test_the_embedded_default_serves_smollm2_on_50051() -> None:
    assert DEFAULT_CONFIG.is_file()
    worker = WorkerSettings.load(None, index=0)
    assert worker.model_name == "smollm2-135m-instruct"
    assert worker.model_path.name == "SmolLM2-135M-Instruct"
    assert TokenizerSettings.load(None).models["smollm2-135m-instruct"] == worker.model_path
    with pytest.raises(SettingsError, match="STRATA_GATEWAY_TOKENIZER_ADDRESS"):
        GatewaySettings.load(None)  # strata up supplies the addresses of the services it started


def test_every_service_takes_rpc_limits_from_the_file_or_environment(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rpc_limits is one section every service shares the shape and defaults of; a bad value is named."""
    monkeypatch.setenv("STRATA_WORKER_RPC_LIMITS__MAX_CONCURRENT_RPCS", "7")
    assert WorkerSettings.load(config, index=0).rpc_limits.max_concurrent_rpcs == 7
    assert GatewaySettings.load(config).rpc_limits == TokenizerSettings.load(config).rpc_limits
    monkeypatch.setenv("STRATA_GATEWAY_RPC_LIMITS__MAX_STREAMS_PER_CONNECTION", "0")
    with pytest.raises(SettingsError, match=r"rpc_limits.max_streams_per_connection=0 must be >= 1"):
        GatewaySettings.load(config)
    monkeypatch.delenv("STRATA_GATEWAY_RPC_LIMITS__MAX_STREAMS_PER_CONNECTION")
    monkeypatch.setenv("STRATA_GATEWAY_HTTP_HEADER_TIMEOUT_S", "0")
    with pytest.raises(SettingsError, match=r"http_header_timeout_s=0.0 must be > 0"):
        GatewaySettings.load(config)
