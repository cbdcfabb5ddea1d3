"""What every Strata service process shares for observability: its settings, its log format, and its
Prometheus endpoint.

`TelemetrySettings` is a nested section of each service's settings (a top-level `telemetry:` section
of the config file is every service's default; a service's own `telemetry:` overrides it key by key).
`start` runs once in a service process, before it serves: log lines become JSON objects (one per
line, with a record's `fields` merged in) or plain text, the metrics registry is served over HTTP at
`metrics_listen` (its bound address written next to the announce file, as `<file>.metrics`), and the
tracing the settings ask for is built. This module must not declare metrics nor spans (each service
does).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import start_http_server
from pydantic import BaseModel, ConfigDict, Field, field_validator

from strata.rpc import check_listen
from strata.tracing import Tracing

if TYPE_CHECKING:
    from pathlib import Path
    from wsgiref.simple_server import WSGIServer

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TelemetrySettings(BaseModel):
    """Traces, metrics and logs of one service."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tracing: Literal["auto", "on", "off"] = "auto"
    """auto: on when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set; on; off (no span built)."""
    otlp_endpoint: str = ""
    """OTLP/gRPC collector, e.g. http://otel-collector:4317; empty: the OTEL_* variable, else localhost."""
    sampling_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    """Fraction of new traces kept (a sampled caller's trace is always kept); unset: OTEL_TRACES_SAMPLER."""
    metrics_listen: str = "127.0.0.1:0"
    """host:port of the Prometheus /metrics endpoint; port 0 takes a free one; empty turns it off."""
    record_content: bool = False
    """Put prompts and completions into spans and request log lines; off, no text of a request is kept."""
    log_format: Literal["json", "text"] = "json"
    """json: one object per line (a finished request is one line with its breakdown); text: for people."""

    @field_validator("metrics_listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        return check_listen(value, "0.0.0.0:9464")


class JsonFormatter(logging.Formatter):
    """A record as one JSON object: time, level, logger, message, exception, plus its `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(log_format: str) -> None:
    """Route the root logger's INFO and above to stderr in `log_format`."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)


@dataclass(slots=True)
class Telemetry:
    """A started service's tracing and metrics endpoint."""

    tracing: Tracing
    metrics_address: str = ""
    """host:port of /metrics; empty when off."""
    _server: WSGIServer | None = None

    def close(self) -> None:
        """Flush spans, stop the metrics endpoint."""
        self.tracing.shutdown()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def start(
    settings: TelemetrySettings,
    service_name: str,
    announce_file: Path | None = None,
    environ: dict[str, str] | None = None,
) -> Telemetry:
    """Logs, /metrics and tracing for this process, as `settings` and the OTEL_* variables say."""
    configure_logging(settings.log_format)
    env = os.environ if environ is None else environ
    telemetry = Telemetry(
        Tracing.start(service_name, settings.tracing, settings.otlp_endpoint, settings.sampling_ratio, env)
    )
    if settings.metrics_listen:
        host, _, port = settings.metrics_listen.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0")
        telemetry.metrics_address = f"{host}:{server.server_port}"
        telemetry._server = server
        if announce_file is not None:
            metrics_file = announce_file.with_name(announce_file.name + ".metrics")
            tmp = metrics_file.with_name(metrics_file.name + ".tmp")
            tmp.write_text(telemetry.metrics_address + "\n")
            os.replace(tmp, metrics_file)
        logging.getLogger(__name__).info("metrics on http://%s/metrics", telemetry.metrics_address)
    return telemetry
