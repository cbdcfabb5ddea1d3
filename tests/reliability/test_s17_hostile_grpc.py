"""Scenario 17: gRPC clients that flood a server or misbehave meet its bounds (strata/rpc_limits.py),
on a real worker server: calls past max_concurrent_rpcs are refused at once with RESOURCE_EXHAUSTED
and a retry hint while health checks still answer; one API key's calls past their share are refused
while another key's are served; one connection holds at most
max_streams_per_connection streams, the rest wait while another connection is served; a client that
pings too often is sent GOAWAY; a frame over the announced size ends its connection. Raw HTTP/2 (the
`h2` library over a socket) plays the client that misbehaves, which grpcio would not. Each test ends
with the server serving a good call. Every service builds its server through the same
strata.rpc.start_server, so the worker stands for all three.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import time
from typing import TYPE_CHECKING

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from strata.status import RETRY_PUSHBACK_KEY, STATUS_DETAILS_KEY, retry_delay_s
from strata.v1 import worker_pb2
from tests.integration.worker_harness import WAIT_S, async_stub, connect, running_worker
from tests.polling import wait_for_async

if TYPE_CHECKING:
    from pathlib import Path

    from strata.v1 import worker_pb2_grpc
    from tests.figures import Figure

ENHANCE_YOUR_CALM = 0xB
REFUSALS = 100
REFUSAL_BOUND_S = 0.25
"""A refusal is decided before any work (about a millisecond on loopback): 5x a 50 ms budget."""


async def _info(
    stub: worker_pb2_grpc.WorkerServiceAsyncStub, metadata: tuple[tuple[str, str], ...] = ()
) -> worker_pb2.GetWorkerInfoResponse:
    info: worker_pb2.GetWorkerInfoResponse = await stub.GetWorkerInfo(
        worker_pb2.GetWorkerInfoRequest(), metadata=metadata, timeout=WAIT_S
    )
    return info


def test_calls_past_the_cap_are_refused_with_a_retry_hint_and_health_still_answers(
    tiny_serving_dir: Path, figure: Figure
) -> None:
    """Two Connect streams hold a worker capped at two calls: further calls of any kind are refused at
    once with RESOURCE_EXHAUSTED naming the limit, a RetryInfo and gRPC pushback; a health check is not
    counted and answers SERVING; once a stream ends, calls are served again."""

    async def main() -> list[float]:
        limits = {"max_concurrent_rpcs": 2, "busy_retry_after_s": 0.25}
        async with running_worker(tiny_serving_dir, rpc_limits=limits) as (server, stub):
            held = [await connect(stub, tiny_serving_dir) for _ in range(2)]
            refusals = []
            for _ in range(REFUSALS):
                started = time.perf_counter()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _info(stub)
                refusals.append(time.perf_counter() - started)
            error = refused.value
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "rpc_limits.max_concurrent_rpcs=2" in (error.details() or "")
            trailers = dict(error.trailing_metadata() or ())
            assert trailers[RETRY_PUSHBACK_KEY] == "250"
            assert retry_delay_s(trailers[STATUS_DETAILS_KEY]) == pytest.approx(0.25)
            async with grpc.aio.insecure_channel(server.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            held[0].call.cancel()
            info = await wait_for_async(
                lambda: _info_or_none(stub), WAIT_S, "a call served once a held stream ended"
            )
            assert info is not None and info.model == "tiny"
            held[1].call.cancel()
            return refusals

    refusals = asyncio.run(main())
    p99 = statistics.quantiles(refusals, n=100)[98]
    figure(17, "calls refused while 2 streams held a server capped at 2", REFUSALS)
    figure(17, "a refusal's round trip, p99", p99 * 1000, "ms")
    assert p99 < REFUSAL_BOUND_S


def test_one_keys_calls_hold_at_most_their_share_and_other_keys_still_come_in(tiny_serving_dir: Path) -> None:
    """Calls carrying one `authorization` value hold at most max_concurrent_rpcs_per_key of the
    server's calls: past it, that key's next call is refused at once naming the limit, while another
    key's call and a call without the header are served; once one of its calls ends, the key is served
    again."""
    flood = (("authorization", "Bearer flood"),)
    other = (("authorization", "Bearer other"),)

    async def main() -> None:
        limits = {"max_concurrent_rpcs": 8, "max_concurrent_rpcs_per_key": 2}
        async with running_worker(tiny_serving_dir, rpc_limits=limits) as (_, stub):
            held = [await connect(stub, tiny_serving_dir, flood) for _ in range(2)]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _info(stub, flood)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "rpc_limits.max_concurrent_rpcs_per_key=2" in (refused.value.details() or "")
            for metadata in (other, ()):
                assert (await _info(stub, metadata)).model == "tiny"
            held[0].call.cancel()
            info = await wait_for_async(
                lambda: _info_or_none(stub, flood), WAIT_S, "the key served once one of its calls ended"
            )
            assert info is not None
            held[1].call.cancel()

    asyncio.run(main())


async def _info_or_none(
    stub: worker_pb2_grpc.WorkerServiceAsyncStub, metadata: tuple[tuple[str, str], ...] = ()
) -> worker_pb2.GetWorkerInfoResponse | None:
    try:
        return await _info(stub, metadata)
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        return None


def test_one_connection_holds_at_most_its_streams_while_another_is_served(
    tiny_serving_dir: Path, figure: Figure
) -> None:
    """The server announces the cap in its HTTP/2 settings; a third stream on a connection capped at
    two waits (no hello) while a stream on a second connection is answered, and starts once one of
    the first two ends."""

    async def main() -> None:
        limits = {"max_streams_per_connection": 2}
        async with running_worker(tiny_serving_dir, rpc_limits=limits) as (server, stub):
            settings = await asyncio.to_thread(_announced_settings, server.address)
            announced = settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS]
            figure(17, "streams per connection, as the server announces it", announced)
            assert announced == 2
            held = [await connect(stub, tiny_serving_dir) for _ in range(2)]
            third = asyncio.create_task(connect(stub, tiny_serving_dir))
            # A local subchannel pool: channels to one address otherwise share one connection.
            separate = [("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(server.address, options=separate) as other:
                elsewhere = await asyncio.wait_for(connect(async_stub(other), tiny_serving_dir), WAIT_S)
                assert not third.done(), "a third stream on a connection capped at two was answered"
                elsewhere.call.cancel()
            held[0].call.cancel()
            started = await asyncio.wait_for(third, WAIT_S)
            for side in (held[1], started):
                side.call.cancel()
            assert (await _info(stub)).model == "tiny"

    asyncio.run(main())


def _announced_settings(address: str) -> dict[int, int]:
    """The settings the server's first SETTINGS frame carries, read over a raw HTTP/2 connection."""
    host, port = address.rsplit(":", 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        while True:
            data = sock.recv(65536)
            assert data, "the server closed before sending its settings"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    return {code: change.new_value for code, change in event.changed_settings.items()}


def test_a_client_that_pings_too_often_is_sent_goaway_and_others_are_served(
    tiny_serving_dir: Path, figure: Figure
) -> None:
    """Pings back to back on an idle connection, past the allowed strikes, end with GOAWAY
    (ENHANCE_YOUR_CALM, too_many_pings); a good client is served after."""

    async def main() -> tuple[h2.events.ConnectionTerminated, int]:
        async with running_worker(tiny_serving_dir, rpc_limits={"max_ping_strikes": 2}) as (server, stub):
            goaway, acked = await asyncio.to_thread(_ping_flood, server.address, 20)
            assert (await _info(stub)).model == "tiny"
            return goaway, acked

    goaway, acked = asyncio.run(main())
    figure(17, "pings sent back to back", 20)
    figure(17, "of them answered before GOAWAY", acked)
    assert goaway.error_code == ENHANCE_YOUR_CALM
    assert b"too_many_pings" in (goaway.additional_data or b"")


def _ping_flood(address: str, pings: int) -> tuple[h2.events.ConnectionTerminated, int]:
    """Send `pings` pings at once after the handshake; the GOAWAY the server answers with, and how
    many pings it acknowledged first."""
    host, port = address.rsplit(":", 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        conn.initiate_connection()
        for _ in range(pings):
            conn.ping(os.urandom(8))
        sock.sendall(conn.data_to_send())
        acked = 0
        while True:
            data = sock.recv(65536)
            assert data, "the server closed the connection without GOAWAY"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.PingAckReceived):
                    acked += 1
                if isinstance(event, h2.events.ConnectionTerminated):
                    return event, acked
            sock.sendall(conn.data_to_send())


def test_a_frame_over_the_announced_size_ends_the_connection_and_others_are_served(
    tiny_serving_dir: Path, figure: Figure
) -> None:
    """A DATA frame one KiB longer than the SETTINGS_MAX_FRAME_SIZE the server announced (written by
    hand: h2 refuses to) is a connection error: the server ends that connection, GOAWAY or a close,
    without answering the stream, and serves others."""

    async def main() -> tuple[int, str]:
        async with running_worker(tiny_serving_dir) as (server, stub):
            found = await asyncio.to_thread(_oversized_frame, server.address)
            assert (await _info(stub)).model == "tiny"
            return found

    limit, ending = asyncio.run(main())
    figure(17, f"a frame 1 KiB over the announced {limit}-byte limit", ending)


def _oversized_frame(address: str) -> tuple[int, str]:
    """Read the server's max frame size, open a stream, send one DATA frame 1 KiB over it; the size
    and how the server ended the connection ("GOAWAY <code>" or "closed"). A response to the stream
    fails the test, as does no end within WAIT_S."""
    limit = _announced_settings(address).get(h2.settings.SettingCodes.MAX_FRAME_SIZE, 16384)
    host, port = address.rsplit(":", 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        conn.initiate_connection()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/strata.v1.WorkerService/GetWorkerInfo"),
            (":authority", address),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        conn.send_headers(1, headers)
        size = limit + 1024
        sock.sendall(conn.data_to_send() + size.to_bytes(3, "big") + b"\x00\x00" + (1).to_bytes(4, "big"))
        try:
            sock.sendall(bytes(size))  # the server may close on reading the frame's header alone
            while data := sock.recv(65536):
                for event in conn.receive_data(data):
                    assert not isinstance(event, h2.events.ResponseReceived), "the oversized frame was served"
                    if isinstance(event, h2.events.ConnectionTerminated):
                        return limit, f"GOAWAY {h2.errors.ErrorCodes(event.error_code or 0).name}"
        except (BrokenPipeError, ConnectionResetError):
            return limit, "connection reset"
        return limit, "connection closed"
