"""Telemetry settings, the JSON log format, and when tracing turns on (settings and OTEL_* variables)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import pytest
import yaml
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.tokenizer.settings import TokenizerSettings
from strata.settings import SettingsError
from strata.telemetry import JsonFormatter, TelemetrySettings
from strata.tracing import Tracing

if TYPE_CHECKING:
    from pathlib import Path


def _config(tmp_path: Path, **sections: object) -> Path:
    path = tmp_path / "stack.yaml"
    tokenizer = {"models": {"m": str(tmp_path)}, **sections.pop("tokenizer_extra", {})}  # type: ignore[dict-item]
    path.write_text(yaml.safe_dump({"tokenizer": tokenizer, **sections}))
    return path


def test_a_top_level_section_is_every_services_default_and_their_own_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = {"tracing": "on", "sampling_ratio": 0.25, "log_format": "text"}
    path = _config(tmp_path, telemetry=shared, tokenizer_extra={"telemetry": {"sampling_ratio": 0.5}})
    telemetry = TokenizerSettings.load(path).telemetry
    assert (telemetry.tracing, telemetry.sampling_ratio, telemetry.log_format) == ("on", 0.5, "text")
    monkeypatch.setenv("STRATA_TOKENIZER_TELEMETRY__TRACING", "off")
    assert TokenizerSettings.load(path).telemetry.tracing == "off"


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("sampling_ratio", 1.5, "less than or equal to 1"),
        ("metrics_listen", "9464", "must be host:port"),
        ("tracing", "maybe", "'auto', 'on' or 'off'"),
    ],
)
def test_bad_values_name_the_field_and_the_fix(tmp_path: Path, field: str, value: object, says: str) -> None:
    path = _config(tmp_path, telemetry={field: value})
    with pytest.raises(SettingsError) as error:
        TokenizerSettings.load(path)
    message = str(error.value)
    assert f"tokenizer.telemetry.{field}" in message and says in message
    assert f"STRATA_TOKENIZER_TELEMETRY__{field.upper()}" in message


def test_json_lines_carry_the_records_fields() -> None:
    record = logging.LogRecord(
        "strata.requests", logging.INFO, __file__, 1, "request %s finished", ("r1",), None
    )
    record.fields = {"request_id": "r1", "timing_ms": {"total_ms": 12.5}}
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request r1 finished" and line["level"] == "info"
    assert line["logger"] == "strata.requests" and line["request_id"] == "r1"
    assert line["timing_ms"] == {"total_ms": 12.5} and line["time"].endswith("Z")


@pytest.mark.parametrize(
    ("tracing", "environ", "enabled"),
    [
        ("auto", {}, False),
        ("auto", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ("auto", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
        ("on", {}, True),
        ("on", {"OTEL_SDK_DISABLED": "true"}, False),
        ("off", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, False),
    ],
)
def test_when_tracing_is_on(tracing: str, environ: dict[str, str], enabled: bool) -> None:
    settings = TelemetrySettings(tracing=tracing)  # type: ignore[arg-type]
    started = Tracing.start(
        "strata-test", settings.tracing, settings.otlp_endpoint, settings.sampling_ratio, environ
    )
    try:
        assert started.enabled is enabled
    finally:
        started.shutdown()


def test_with_tracing_off_nothing_is_built() -> None:
    off = Tracing.off()
    assert off.span("anything", start=0.0, end=1.0) is None
    assert (
        off.carrier(None) == {}
        and off.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    )


def test_the_sampling_ratio_keeps_new_traces_but_always_follows_a_sampled_caller() -> None:
    exporter = InMemorySpanExporter()
    never = Tracing.with_exporter("strata-test", exporter, 0.0, batch=False)
    never.end(never.span("new trace"))
    caller = never.extract({"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
    never.end(never.span("joins a sampled caller", parent=caller))
    assert [span.name for span in exporter.get_finished_spans()] == ["joins a sampled caller"]
    never.shutdown()
