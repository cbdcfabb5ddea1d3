"""The one way every Strata service reads its settings: a YAML section, then STRATA_* environment.

Each service declares one frozen pydantic-settings model (a subclass of ServiceSettings) naming its
YAML section and environment prefix; `load` reads the file once at start. Environment variables win
over the file so an operator can override one value without editing it. Relative paths in a file are
relative to that file; a top-level `telemetry:` section is the default of every service's own. This
module must not read anything at import time nor know any service's fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import yaml
from pydantic import ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from strata.rpc import check_listen
from strata.rpc_limits import RpcLimits
from strata.telemetry import TelemetrySettings
from strata.tls import TlsSettings

if TYPE_CHECKING:
    from collections.abc import Mapping

# The embedded default stack: SmolLM2-135M-Instruct, gateway on 127.0.0.1:50051.
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"
# Nested sections whose `*_file` values are paths relative to the config file.
TLS_SECTIONS = ("tls", "internal_tls")


class SettingsError(ValueError):
    """Settings that cannot start a service; the message names each bad value and the fix."""


def read_config(path: Path) -> dict[str, Any]:
    """The parsed YAML file; a missing or malformed file is a SettingsError."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise SettingsError(
            f"config file {path} does not exist; pass --config with an existing file"
        ) from exc
    except yaml.YAMLError as exc:
        raise SettingsError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of sections, not {type(data).__name__}")
    return data


def resolve_path(value: object, base: Path) -> object:
    """A relative path string from a file is relative to that file's folder."""
    if isinstance(value, str) and value and not Path(value).is_absolute():
        return str((base / value).resolve())
    return value


class ServiceSettings(BaseSettings):
    """Base of the per-service settings models: frozen, strict about unknown keys, env over file."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", env_nested_delimiter="__")

    telemetry: TelemetrySettings = TelemetrySettings()
    """Traces, metrics and logs; a top-level `telemetry:` section of the file is every service's default."""
    tls: TlsSettings | None = None
    """TLS on the main port: this server's certificate and key, and with client_ca_file mutual TLS
    (callers must present a certificate that CA signed); unset: plaintext. The health port stays
    plaintext."""
    health_listen: str = ""
    """host:port of a plaintext server that serves only gRPC health (probes: readiness under "" and the
    service's name, `liveness` while the process serves); empty: health on the main port only."""
    rpc_limits: RpcLimits = RpcLimits()
    """What clients may hold of the main port: calls at once, streams per connection, ping strikes
    (strata/rpc_limits.py, docs/security.md)."""

    @field_validator("health_listen")
    @classmethod
    def _health_host_port(cls, value: str) -> str:
        return check_listen(value, "0.0.0.0:8081")

    section: ClassVar[str] = ""
    """The service's key in the YAML file."""
    path_fields: ClassVar[tuple[str, ...]] = ()
    """Top-level fields holding paths, resolved against the config file's folder."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values arrive as init kwargs; the environment must override them.
        return (env_settings, init_settings)

    @classmethod
    def section_data(cls, config: Mapping[str, Any], path: Path, index: int | None = None) -> dict[str, Any]:
        """The service's section of a parsed file, with relative paths resolved."""
        raw = config.get(cls.section, {})
        if index is not None:
            if not isinstance(raw, list) or not 0 <= index < len(raw):
                count = len(raw) if isinstance(raw, list) else 0
                raise SettingsError(
                    f"{path}: section '{cls.section}' has {count} entries, so index {index} does not exist; "
                    f"pass an index below {count}"
                )
            raw = raw[index]
        if not isinstance(raw, dict):
            raise SettingsError(
                f"{path}: section '{cls.section}' must be a mapping, not {type(raw).__name__}"
            )
        data = dict(raw)
        shared = config.get("telemetry")
        if isinstance(shared, dict):
            own = data.get("telemetry")
            data["telemetry"] = {**shared, **own} if isinstance(own, dict) else {**shared}
        for name in cls.path_fields:
            if name in data:
                data[name] = resolve_path(data[name], path.parent)
        for name in TLS_SECTIONS:
            if isinstance(data.get(name), dict):
                data[name] = {
                    key: resolve_path(value, path.parent) if key.endswith("_file") else value
                    for key, value in data[name].items()
                }
        return cls.resolve_nested_paths(data, path.parent)

    @classmethod
    def resolve_nested_paths(cls, data: dict[str, Any], base: Path) -> dict[str, Any]:
        """Hook for paths below the top level (a mapping of model paths, say)."""
        return data

    @classmethod
    def load(cls, config: Path | None = None, *, index: int | None = None) -> Self:
        """Build the settings from `config` (the embedded default when None) and the environment."""
        path = (config or DEFAULT_CONFIG).resolve()
        data = cls.section_data(read_config(path), path, index)
        return cls.build(data, source=str(path))

    @classmethod
    def build(cls, data: Mapping[str, Any], *, source: str = "<arguments>") -> Self:
        """Build from a mapping plus the environment; errors name the value and the fix."""
        try:
            return cls(**data)
        except ValidationError as exc:
            raise SettingsError(describe_errors(cls, exc, source)) from None


def describe_errors(cls: type[ServiceSettings], exc: ValidationError, source: str) -> str:
    prefix = str(cls.model_config.get("env_prefix", ""))
    lines = [f"invalid {cls.section} settings (from {source} and {prefix}* environment variables):"]
    for error in exc.errors():
        loc = error["loc"]
        if not loc:  # a check across fields: its message names them
            lines.append(
                f"  {cls.section}: {error['msg']}; fix it in the '{cls.section}' section or its {prefix}*"
            )
            continue
        where = ".".join(str(part) for part in loc)
        env = prefix + "__".join(str(part) for part in loc if not isinstance(part, int)).upper()
        got = "" if error["type"] == "missing" else f"={error.get('input')!r}"
        fix = f"fix it in the '{cls.section}' section or set {env}"
        lines.append(f"  {cls.section}.{where}{got}: {error['msg']}; {fix}")
    return "\n".join(lines)
