"""What the two tenants of `python -m bench.flood` send: the flood, from a process of its own, and the
quiet tenant's trickle.

The flood process opens `connections` HTTP/2 connections to the gateway (one grpc.aio channel each, with
a local subchannel pool so that no two share a socket), waits until every one is connected, then on the
parent's word starts `streams` GenerateStream calls spread over them, all at once, each naming the flood
tenant by its key. Each of them is a stream the tenant means to keep open: refused, it is sent again
after the refusal's retry hint, doubled at each refusal in a row up to MAX_BACKOFF_S, as SDK clients
back off; ended, it is sent again at once. So the flood holds every slot admission lets it take, for as
long as it runs. It reads its tokens until the parent says stop; then it cancels what still runs, closes
the connections and sends back how its calls ended: "OK" (it ran to its end), or the status code's name
with who refused it (the RPC caps of strata/rpc_limits.py, or admission), with each refusal's time at
the client and in the gateway (the strata-elapsed-ms trailer, arrival to refusal). The process runs at
the lowest CPU priority: an attacker's own CPU is not the served machine's, and here the two share two
cores. The parent talks to it over a pipe: "connected" and "launched" from the child, "go" and "stop" to
it. The quiet tenant's requests go from the parent's own event loop through bench/driver.py's `send`,
which times their first token. This module must not start a stack nor judge the results (bench/flood.py
does).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from strata.retry import pushback_delay_s, retry_info_delay_s
from strata.rpc import MIB, channel_options
from strata.status import elapsed_s
from strata.v1 import gateway_pb2_grpc

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from bench.driver import Metadata
    from strata.v1 import gateway_pb2

CONNECT_TIMEOUT_S = 120.0
MAX_BACKOFF_S = 30.0
DEFAULT_BACKOFF_S = 1.0
"""The wait after a refusal that carries no retry hint."""
RPC_CAP_MARK = "rpc_limits."
"""The RPC caps' refusals name their setting (strata/rpc_limits.py); admission's do not."""


@dataclass(slots=True)
class FloodOutcome:
    """How the flood's calls ended."""

    admitted: int = 0
    """Calls that got a first token before they were stopped (or ended)."""
    calls: int = 0
    """Calls sent, first tries and retries."""
    statuses: dict[str, int] = field(default_factory=dict)
    """Calls by how they ended: OK (ran to its end), "RESOURCE_EXHAUSTED (rpc cap|admission)", or
    another code with the start of its message; a call still running when stopped is in none."""
    refusal_client_s: list[float] = field(default_factory=list)
    """Each RESOURCE_EXHAUSTED call's time at the client, send to refusal."""
    refusal_gateway_s: list[float] = field(default_factory=list)
    """Of those the admission refused, each one's time in the gateway (its elapsed trailer)."""
    stopping: bool = False
    """The parent said stop: a call ending now was cancelled by it, not answered."""
    connect_s: float = 0.0
    """Seconds from the first connection opened to the last one ready."""
    launch_s: float = 0.0
    """Seconds to start every call."""


def start_flood(
    address: str, connections: int, streams: int, request: gateway_pb2.GenerateRequest, metadata: Metadata
) -> tuple[multiprocessing.process.BaseProcess, Connection]:
    """The flood process, started and connecting; its end of the pipe."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(
        target=_flood_main,
        args=(address, connections, streams, request.SerializeToString(), metadata, child),
        daemon=True,
    )
    process.start()
    child.close()
    return process, parent


def _flood_main(
    address: str, connections: int, streams: int, request: bytes, metadata: Metadata, pipe: Connection
) -> None:
    os.nice(19)
    asyncio.run(_flood(address, connections, streams, request, metadata, pipe))


async def _flood(
    address: str, connections: int, streams: int, payload: bytes, metadata: Metadata, pipe: Connection
) -> None:
    from strata.v1 import gateway_pb2

    request = gateway_pb2.GenerateRequest.FromString(payload)
    outcome = FloodOutcome()
    options = [*channel_options(4 * MIB), ("grpc.use_local_subchannel_pool", 1)]
    started = time.perf_counter()
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(connections)]
    await asyncio.wait_for(
        asyncio.gather(*(channel.channel_ready() for channel in channels)), CONNECT_TIMEOUT_S
    )
    outcome.connect_s = time.perf_counter() - started
    pipe.send("connected")
    await asyncio.to_thread(pipe.recv)  # "go"
    stubs = [gateway_pb2_grpc.GatewayStub(channel) for channel in channels]
    started = time.perf_counter()
    rng = random.Random("bench-flood")
    streams_held = [
        asyncio.ensure_future(_hold(stubs[index % connections], request, metadata, outcome, rng))
        for index in range(streams)
    ]
    outcome.launch_s = time.perf_counter() - started
    pipe.send("launched")
    await asyncio.to_thread(pipe.recv)  # "stop"
    outcome.stopping = True
    for stream in streams_held:
        stream.cancel()
    await asyncio.gather(*streams_held, return_exceptions=True)
    await asyncio.gather(*(channel.close() for channel in channels))
    pipe.send(outcome)


async def _hold(
    stub: gateway_pb2_grpc.GatewayStub,
    request: gateway_pb2.GenerateRequest,
    metadata: Metadata,
    outcome: FloodOutcome,
    rng: random.Random,
) -> None:
    """One stream the flood keeps open: sent again when it ends, after a backoff when refused. Runs
    until cancelled (the parent's stop), which ends the call in flight."""
    refusals = 0
    while True:
        hint = await _one(stub, request, metadata, outcome)
        if hint is None:
            refusals = 0
            continue
        refusals += 1
        # Full jitter, as SDK clients do, so the refused streams do not all come back together.
        await asyncio.sleep(rng.uniform(0.5, 1.0) * min(MAX_BACKOFF_S, hint * 2 ** (refusals - 1)))


async def _one(
    stub: gateway_pb2_grpc.GatewayStub,
    request: gateway_pb2.GenerateRequest,
    metadata: Metadata,
    outcome: FloodOutcome,
) -> float | None:
    """One call, counted in `outcome`; the wait its refusal asks for, None when it was not refused."""
    sent = time.perf_counter()
    outcome.calls += 1
    first = True
    try:
        async for message in stub.GenerateStream(request, metadata=metadata):
            if message.token_ids and first:
                first = False
                outcome.admitted += 1
    except grpc.aio.AioRpcError as error:
        if outcome.stopping:
            raise asyncio.CancelledError from error
        details = error.details() or ""
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            status = f"{error.code().name} ({'rpc cap' if RPC_CAP_MARK in details else 'admission'})"
        else:
            status = f"{error.code().name}: {details[:80]}"
        outcome.statuses[status] = outcome.statuses.get(status, 0) + 1
        trailers = list(error.trailing_metadata() or ())
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            outcome.refusal_client_s.append(time.perf_counter() - sent)
            inside = elapsed_s(trailers)
            if inside is not None:
                outcome.refusal_gateway_s.append(inside)
        hints = [h for h in (retry_info_delay_s(trailers), pushback_delay_s(trailers)) if h is not None]
        return max(hints) if hints else DEFAULT_BACKOFF_S
    outcome.statuses["OK"] = outcome.statuses.get("OK", 0) + 1
    return None
