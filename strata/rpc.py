"""Plumbing every Strata gRPC server shares: binding, message bounds, health, reflection, announcing.

Each service builds a grpc.aio server through `start_server`, which binds its listen address (port 0
takes one from the OS), registers grpc.health.v1 and reflection, and, when asked, writes the bound
address to an announce file so a launcher or a test finds an ephemeral port. Services set their own
health status; this module must not decide when a service is ready, nor map errors to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from strata.rpc_limits import RpcCap, RpcLimits

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    from strata.tls import ClientTlsSettings, TlsSettings

MIB = 1 << 20
HEALTH_SERVICE = health.SERVICE_NAME
LIVENESS = "liveness"
"""The health service name a liveness probe asks for: SERVING while the process serves at all."""
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# A peer that stops answering (SIGSTOP, a frozen VM, a cut link) while its TCP connection stays up is
# noticed only by HTTP/2 pings: one every KEEPALIVE_MS, closing the transport when its ack is
# PING_TIMEOUT_MS late, so a frozen peer is dropped within about two seconds, not at some deadline.
KEEPALIVE_MS = 1_000
PING_TIMEOUT_MS = 1_000
# Servers must accept pings that often, or they answer GOAWAY "too_many_pings" and the client backs off.
MIN_RECV_PING_INTERVAL_MS = 500
# A peer that comes back (SIGCONT, a restart) is reached again within about a second: gRPC's own
# reconnect backoff would otherwise grow to two minutes, and a connection attempt to a frozen peer
# would hang for twenty seconds.
RECONNECT_BACKOFF_MS = (100, 1_000)
CONNECT_TIMEOUT_MS = 1_000


def check_listen(value: str, example: str) -> str:
    """`value` when it is empty or host:port (a settings validator); ValueError naming `example` else."""
    host, sep, port = value.rpartition(":")
    if value and not (sep and host and port.isdigit() and int(port) < 65536):
        raise ValueError(f"must be host:port (port 0 takes a free one), e.g. {example}, not {value!r}")
    return value


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Bounds on message size both ways, keepalive pings with a timeout, and a short reconnect backoff."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
        ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ]


def aio_channel(
    address: str, options: Sequence[tuple[str, Any]], tls: ClientTlsSettings | None = None
) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS (mutual when `tls` names a client certificate) or plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=[*options, *tls.channel_options()]
    )


def sync_channel(
    address: str, options: Sequence[tuple[str, Any]], tls: ClientTlsSettings | None = None
) -> grpc.Channel:
    """A blocking channel to `address`, like aio_channel."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()])


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The channel options (so a server notices a frozen client too) and tolerance of clients' pings."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_RECV_PING_INTERVAL_MS),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_RECV_PING_INTERVAL_MS),
        # A restarted service must never share its port with a predecessor that still holds it (frozen
        # by SIGSTOP, say) and get half its traffic: gRPC turns SO_REUSEPORT on unless told not to.
        ("grpc.so_reuseport", 0),
    ]


@dataclass
class RunningServer:
    """A started server, the address it is bound to, its health servicer and its health-only server."""

    server: grpc.aio.Server
    address: str
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    health_server: grpc.aio.Server | None = None
    health_address: str = ""
    """host:port of the plaintext health-only server; empty when there is none."""

    async def set_serving(self, serving: bool) -> None:
        """Readiness of the whole server and of each service it hosts (never liveness)."""
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float | None) -> None:
        """Stop serving calls (letting those in flight finish for `grace` seconds), then health."""
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(None)


async def start_server(
    listen: str,
    *,
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Sequence[str],
    max_message_bytes: int,
    limits: RpcLimits,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    announce_file: Path | None = None,
    health_listen: str = "",
    tls: TlsSettings | None = None,
) -> RunningServer:
    """Bind, register services plus health and reflection, start; readiness starts NOT_SERVING.

    With `health_listen`, a second plaintext server there serves only grpc.health.v1.Health (the
    same statuses), for probes that must work whatever the main port's transport security; there
    LIVENESS reads SERVING for as long as the process serves, whatever its readiness. With `tls` the
    main port speaks TLS (mutual TLS when it names a client CA); the health-only port stays plaintext.
    `limits` bound what clients may hold (strata/rpc_limits.py); the count of calls wraps every other
    interceptor's handler, so a call past the cap is refused before any handler runs.
    """
    server = grpc.aio.server(
        options=[*server_options(max_message_bytes), *limits.server_options()],
        interceptors=[RpcCap(limits), *interceptors],
    )
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(service_names)
    reflection.enable_server_reflection((*names, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    if tls is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, tls.server_credentials())
    if port == 0:
        raise OSError(f"could not bind {listen}; choose a free port (port 0 lets the OS choose)")
    host = listen.rsplit(":", 1)[0]
    address = f"{host}:{port}"
    running = RunningServer(server, address, health_servicer, names)
    await running.set_serving(False)
    await health_servicer.set(LIVENESS, SERVING)
    if health_listen:
        running.health_server, running.health_address = _health_only(health_servicer, health_listen)
        await running.health_server.start()
    await server.start()
    if announce_file is not None:
        if running.health_address:  # first, so a reader of the address finds it complete
            announce(announce_file.with_name(announce_file.name + ".health"), running.health_address)
        announce(announce_file, address)
    return running


def _health_only(servicer: health.aio.HealthServicer, listen: str) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=server_options(64 * 1024))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"could not bind health_listen {listen}; choose a free port")
    return server, f"{listen.rsplit(':', 1)[0]}:{port}"


def announce(path: Path, address: str) -> None:
    """Write the bound address atomically, so a reader never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(address + "\n")
    os.replace(tmp, path)


def shutdown_event() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT, for a service's graceful stop."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):  # signal handlers need the main thread on Unix
            loop.add_signal_handler(sig, event.set)
    return event
