"""Transport security settings and the gRPC credentials built from them.

A server's `tls` names its certificate chain and key; with `client_ca_file` it also demands a client
certificate signed by that CA (mutual TLS), so only holders of such a certificate (the gateway) can
call it. A caller's `ClientTlsSettings` name the CA that signed the servers' certificates and, for
mutual TLS, its own certificate and key. Files are read once, at start; a missing or unreadable file
is a settings error naming the field. This module must not open ports or channels (strata.rpc does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

import grpc
from pydantic import BaseModel, ConfigDict, model_validator


def _read(path: Path | None, field: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path}: {exc.strerror}; point it at a PEM file") from exc


class TlsSettings(BaseModel):
    """A server's certificate, and the CA its clients' certificates must chain to (mutual TLS)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cert_file: Path
    """PEM certificate chain of this server (its names must match what callers dial)."""
    key_file: Path
    """PEM private key of that certificate."""
    client_ca_file: Path | None = None
    """PEM CA bundle: when set, a client must present a certificate it signed (mutual TLS)."""

    @model_validator(mode="after")
    def _readable(self) -> Self:
        for field in ("cert_file", "key_file", "client_ca_file"):
            _read(getattr(self, field), field)
        return self

    def server_credentials(self) -> grpc.ServerCredentials:
        key, cert = _read(self.key_file, "key_file"), _read(self.cert_file, "cert_file")
        assert key is not None and cert is not None
        client_ca = _read(self.client_ca_file, "client_ca_file")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )


class ClientTlsSettings(BaseModel):
    """How a caller checks a server's certificate and, for mutual TLS, proves who it is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ca_file: Path | None = None
    """PEM CA bundle that signed the servers' certificates; unset: the system's roots."""
    cert_file: Path | None = None
    """PEM client certificate (mutual TLS); needs key_file."""
    key_file: Path | None = None
    """PEM private key of cert_file."""
    server_name: str = ""
    """The name to check the server's certificate against instead of the dialled host."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: set both for mutual TLS, or neither")
        for field in ("ca_file", "cert_file", "key_file"):
            _read(getattr(self, field), field)
        return self

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "ca_file"),
            private_key=_read(self.key_file, "key_file"),
            certificate_chain=_read(self.cert_file, "cert_file"),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
