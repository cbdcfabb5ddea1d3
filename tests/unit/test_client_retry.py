"""The client's retry rules: the pure decision (strata.retry) and both clients against a real gRPC server.

The server tests run a real in-process grpc.aio server implementing strata.v1.Gateway with a scripted
test servicer: a test double of the gateway, used only to make it fail on purpose (RESOURCE_EXHAUSTED
with a RetryInfo, pushback, a stream that breaks after its first message) and to count the calls.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from strata.client import AsyncStrataClient, StrataClient, build_request
from strata.retry import (
    PUSHBACK_KEY,
    RetryPolicy,
    backoff_s,
    pushback_delay_s,
    retry_delay_s,
    retry_info_delay_s,
)
from strata.status import STATUS_DETAILS_KEY
from strata.v1 import gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def rich_status_trailer(delay_s: float, code: int = code_pb2.RESOURCE_EXHAUSTED) -> tuple[str, bytes]:
    """The 'grpc-status-details-bin' trailer of a google.rpc.Status carrying a RetryInfo."""
    info = error_details_pb2.RetryInfo()
    info.retry_delay.CopyFrom(duration_pb2.Duration(seconds=int(delay_s), nanos=round(delay_s % 1 * 1e9)))
    status = status_pb2.Status(code=code, message="queue full")
    status.details.add().Pack(info)
    return (STATUS_DETAILS_KEY, status.SerializeToString())


# --- the pure decision -------------------------------------------------------------------------


def test_retry_info_is_read_from_a_real_google_rpc_status() -> None:
    assert retry_info_delay_s([rich_status_trailer(0.25)]) == pytest.approx(0.25)
    assert retry_info_delay_s([rich_status_trailer(3.0)]) == pytest.approx(3.0)
    assert retry_info_delay_s([("other", "x")]) is None
    assert retry_info_delay_s(None) is None


def test_a_status_without_retry_info_or_garbage_gives_no_hint() -> None:
    plain = status_pb2.Status(code=code_pb2.UNAVAILABLE, message="down")
    plain.details.add().Pack(error_details_pb2.DebugInfo(detail="x"))
    assert retry_info_delay_s([(STATUS_DETAILS_KEY, plain.SerializeToString())]) is None
    assert retry_info_delay_s([(STATUS_DETAILS_KEY, b"\xff\xff\xff")]) is None


def test_pushback_parsing() -> None:
    assert pushback_delay_s([(PUSHBACK_KEY, "250")]) == pytest.approx(0.25)
    assert pushback_delay_s([(PUSHBACK_KEY, b"1000")]) == pytest.approx(1.0)
    assert pushback_delay_s([(PUSHBACK_KEY, "-1")]) == -1.0
    assert pushback_delay_s([(PUSHBACK_KEY, "soon")]) == -1.0
    assert pushback_delay_s([]) is None


def test_hint_is_honoured_over_backoff_and_the_longer_hint_wins() -> None:
    policy = RetryPolicy()
    assert retry_delay_s(policy, EXHAUSTED, [rich_status_trailer(0.05)], 1, None) == pytest.approx(0.05)
    both: list[tuple[str, str | bytes]] = [rich_status_trailer(0.05), (PUSHBACK_KEY, "700")]
    assert retry_delay_s(policy, UNAVAILABLE, both, 1, None) == pytest.approx(0.7)


def test_negative_pushback_forbids_a_retry() -> None:
    assert retry_delay_s(RetryPolicy(), UNAVAILABLE, [(PUSHBACK_KEY, "-1")], 1, None) is None


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INTERNAL,
        None,
    ],
)
def test_other_codes_are_never_retried(code: grpc.StatusCode | None) -> None:
    assert retry_delay_s(RetryPolicy(), code, [rich_status_trailer(0.05)], 1, None) is None


def test_attempts_are_bounded() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert retry_delay_s(policy, EXHAUSTED, None, 2, None) is not None
    assert retry_delay_s(policy, EXHAUSTED, None, 3, None) is None
    assert retry_delay_s(RetryPolicy(max_attempts=1), EXHAUSTED, None, 1, None) is None


def test_deadline_caps_the_wait() -> None:
    hint = [rich_status_trailer(2.0)]
    assert retry_delay_s(RetryPolicy(), EXHAUSTED, hint, 1, 1.5) is None
    assert retry_delay_s(RetryPolicy(), EXHAUSTED, hint, 1, 2.5) == pytest.approx(2.0)
    assert retry_delay_s(RetryPolicy(), EXHAUSTED, None, 1, 0.01) is None


def test_a_hint_too_long_goes_to_the_caller() -> None:
    policy = RetryPolicy(max_hinted_delay_s=1.0)
    assert retry_delay_s(policy, EXHAUSTED, [(PUSHBACK_KEY, "5000")], 1, None) is None


def test_backoff_doubles_from_100ms_with_jitter_and_caps_at_5s() -> None:
    policy = RetryPolicy()
    rng = random.Random(7)
    for attempt, ceiling in [(1, 0.1), (2, 0.2), (3, 0.4), (7, 5.0), (30, 5.0)]:
        draws = [backoff_s(policy, attempt, rng) for _ in range(50)]
        assert all(ceiling * (1 - policy.jitter) - 1e-9 <= d <= ceiling + 1e-9 for d in draws)
        assert len(set(draws)) > 1
    no_jitter = RetryPolicy(jitter=0.0)
    assert backoff_s(no_jitter, 2) == pytest.approx(0.2)


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="jitter"):
        RetryPolicy(jitter=2.0)


def test_build_request_accepts_tuples_and_dicts_and_leaves_unset_fields_unset() -> None:
    request = build_request(
        messages=[("system", "be brief"), {"role": "user", "content": "hi"}], seed=3, truncation="left"
    )
    assert [(m.role, m.content) for m in request.messages] == [("system", "be brief"), ("user", "hi")]
    assert request.sampling.HasField("seed") and request.sampling.seed == 3
    assert not request.sampling.HasField("top_p")
    assert request.truncation == gateway_pb2.TRUNCATION_LEFT
    with pytest.raises(ValueError, match="truncation"):
        build_request("x", truncation="middle")
    with pytest.raises(ValueError, match="role"):
        build_request(messages=[{"content": "no role"}])


# --- real server ---------------------------------------------------------------------------------


@dataclass
class Script:
    """What the test servicer does: fail the first `fail_first` calls, then answer."""

    fail_first: int = 0
    code: grpc.StatusCode = EXHAUSTED
    trailers: tuple[tuple[str, str | bytes], ...] = ()
    stream_fails_after_first: bool = False
    calls: int = 0
    call_times: list[float] = field(default_factory=list)


class ScriptedGateway(gateway_pb2_grpc.GatewayServicer):
    """A test double of the gateway: fails on purpose and counts calls."""

    def __init__(self, script: Script) -> None:
        self.script = script

    async def _maybe_fail(self, context: grpc.aio.ServicerContext) -> None:
        self.script.calls += 1
        self.script.call_times.append(time.monotonic())
        if self.script.calls <= self.script.fail_first:
            await context.abort(self.script.code, "queue full", trailing_metadata=self.script.trailers)

    async def Generate(self, request, context):
        await self._maybe_fail(context)
        return gateway_pb2.GenerateResponse(text=f"echo {request.prompt}", model="scripted")

    async def GenerateStream(self, request, context) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        if not self.script.stream_fails_after_first:
            await self._maybe_fail(context)
        else:
            self.script.calls += 1
        yield gateway_pb2.GenerateStreamResponse(text="first")
        if self.script.stream_fails_after_first:
            await context.abort(UNAVAILABLE, "worker died", trailing_metadata=(rich_status_trailer(0.01),))
        final = gateway_pb2.GenerateResponse(text="first", model="scripted")
        yield gateway_pb2.GenerateStreamResponse(final=final)

    async def ListModels(self, request, context):
        await self._maybe_fail(context)
        return gateway_pb2.ListModelsResponse(default_model="scripted")


async def start_server(script: Script) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(ScriptedGateway(script), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextmanager
def server_thread(script: Script) -> Iterator[str]:
    """The aio server on its own event loop in a thread, for the blocking client."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, address = asyncio.run_coroutine_threadsafe(start_server(script), loop).result(10)
    try:
        yield address
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


HINT_50MS = (rich_status_trailer(0.05),)


def test_sync_client_waits_the_retry_info_hint_then_succeeds() -> None:
    script = Script(fail_first=2, trailers=HINT_50MS)
    with server_thread(script) as address, StrataClient(address) as client:
        started = time.monotonic()
        response = client.generate("hi", timeout=10)
        elapsed = time.monotonic() - started
    assert response.text == "echo hi"
    assert script.calls == 3
    gaps = [b - a for a, b in zip(script.call_times, script.call_times[1:], strict=False)]
    assert all(gap >= 0.05 for gap in gaps), gaps
    assert elapsed >= 0.1


def test_sync_client_honours_pushback_and_retries_list_models() -> None:
    script = Script(fail_first=1, code=UNAVAILABLE, trailers=((PUSHBACK_KEY, "80"),))
    with server_thread(script) as address, StrataClient(address) as client:
        assert client.list_models(timeout=10).default_model == "scripted"
    assert script.calls == 2
    assert script.call_times[1] - script.call_times[0] >= 0.08


def test_sync_client_gives_up_after_max_attempts_with_the_servers_error() -> None:
    script = Script(fail_first=10, trailers=HINT_50MS)
    retry = RetryPolicy(max_attempts=3)
    with (
        server_thread(script) as address,
        StrataClient(address, retry=retry) as client,
        pytest.raises(grpc.RpcError) as raised,
    ):
        client.generate("hi", timeout=10)
    assert isinstance(raised.value, grpc.Call)
    assert raised.value.code() == EXHAUSTED
    assert raised.value.details() == "queue full"
    assert script.calls == 3


def test_sync_client_never_retries_invalid_argument() -> None:
    script = Script(fail_first=1, code=grpc.StatusCode.INVALID_ARGUMENT, trailers=HINT_50MS)
    with (
        server_thread(script) as address,
        StrataClient(address) as client,
        pytest.raises(grpc.RpcError) as raised,
    ):
        client.generate("hi", timeout=10)
    assert isinstance(raised.value, grpc.Call)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert script.calls == 1


def test_sync_client_does_not_wait_past_the_timeout() -> None:
    script = Script(fail_first=1, trailers=(rich_status_trailer(5.0),))
    with server_thread(script) as address, StrataClient(address) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError):
            client.generate("hi", timeout=1.0)
        elapsed = time.monotonic() - started
    assert script.calls == 1
    assert elapsed < 1.0


def test_sync_stream_retries_before_its_first_message_only() -> None:
    script = Script(fail_first=1, trailers=HINT_50MS)
    with server_thread(script) as address, StrataClient(address) as client:
        messages = list(client.generate_stream("hi", timeout=10))
    assert [m.text for m in messages] == ["first", ""]
    assert messages[-1].final.model == "scripted"
    assert script.calls == 2

    broken = Script(stream_fails_after_first=True)
    with server_thread(broken) as address, StrataClient(address) as client:
        received = []
        with pytest.raises(grpc.RpcError) as raised:
            for message in client.generate_stream("hi", timeout=10):
                received.append(message.text)
    assert received == ["first"]
    assert isinstance(raised.value, grpc.Call)
    assert raised.value.code() == UNAVAILABLE
    assert broken.calls == 1


def test_async_client_retries_and_never_replays_a_started_stream() -> None:
    async def scenario() -> None:
        script = Script(fail_first=2, trailers=HINT_50MS)
        server, address = await start_server(script)
        try:
            async with AsyncStrataClient(address) as client:
                started = time.monotonic()
                response = await client.generate("hi", timeout=10)
                assert time.monotonic() - started >= 0.1
                assert response.text == "echo hi"
                assert script.calls == 3
                texts = [m.text async for m in client.generate_stream("again", timeout=10)]
                assert texts == ["first", ""]
                assert script.calls == 4
        finally:
            await server.stop(None)

        broken = Script(stream_fails_after_first=True)
        server, address = await start_server(broken)
        try:
            async with AsyncStrataClient(address) as client:
                received = []
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    async for message in client.generate_stream("hi", timeout=10):
                        received.append(message.text)
                assert received == ["first"]
                assert raised.value.code() == UNAVAILABLE
                assert broken.calls == 1
        finally:
            await server.stop(None)

    asyncio.run(scenario())
