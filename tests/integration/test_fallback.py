"""Fallback to a smaller model, each trigger end to end: the real tokenizer service, a primary worker,
a fallback worker (another tiny model with the same tokenizer files) and the gateway, in-process on
ephemeral ports.

The servers run on one event loop in a background thread; the tests call the gateway with ordinary
blocking gRPC clients. The tokenizer and the fallback worker live for the module; each test starts
its own primary worker and gateway, and breaks the primary the way its trigger needs: never started,
stopped, saturated, failing every step (the engine's simulated out-of-memory), or torn down abruptly
mid-stream (its gRPC server stopped with no grace, as a crash looks to the gateway).
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from prometheus_client import REGISTRY

from gateway.errors import STATUS_DETAILS_KEY, retry_delay_s
from strata.v1 import common_pb2, gateway_pb2
from tests.integration.fallback_harness import FALLBACK, OTHER, PRIMARY, PROMPT, WAIT_S, Stack
from tests.polling import wait_for

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from services.worker.server import WorkerServer

# The target: new requests reach a restarted primary within 2 s. The bounds asserted are 5x that.
RECOVERY_BOUND_S = 10.0


@pytest.fixture(scope="module")
def other_tokenizer_dir(tiny_fallback_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_fallback_dir with another decoding setting in its tokenizer_config.json (a tokenizer that
    turns the same ids into other text)."""
    directory = tmp_path_factory.mktemp("tiny-other")
    for path in tiny_fallback_dir.iterdir():
        shutil.copyfile(path, directory / path.name)
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["clean_up_tokenization_spaces"] = not config.get("clean_up_tokenization_spaces", False)
    path.write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def stack(tiny_serving_dir: Path, tiny_fallback_dir: Path, other_tokenizer_dir: Path) -> Iterator[Stack]:
    with Stack(tiny_serving_dir, tiny_fallback_dir, other_tokenizer_dir) as stack:
        yield stack


def _request(
    max_new_tokens: int = 8, stop: tuple[str, ...] = (), **fields: Any
) -> gateway_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_new_tokens=max_new_tokens, stop=stop)
    return gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling, **fields)


def _fallbacks(reason: str) -> float:
    value = REGISTRY.get_sample_value("strata_fallbacks_total", {"model": PRIMARY, "reason": reason})
    return value or 0.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _served_by(stub: Any, model: str) -> Callable[[], gateway_pb2.GenerateResponse | None]:
    def probe() -> gateway_pb2.GenerateResponse | None:
        response: gateway_pb2.GenerateResponse = stub.Generate(_request(2), timeout=30)
        return response if response.model == model else None

    return probe


def _measure_return(stack: Stack, stub: Any, listen: str) -> tuple[WorkerServer, float]:
    """Start the primary on `listen`; seconds from its readiness until the gateway serves from it."""
    primary = stack.start_primary(listen)
    ready = time.monotonic()
    wait_for(_served_by(stub, PRIMARY), RECOVERY_BOUND_S, "the returned primary served")
    elapsed = time.monotonic() - ready
    return primary, elapsed


def test_an_unavailable_primary_is_served_by_the_fallback_until_it_returns(stack: Stack) -> None:
    port = _free_port()
    listen = f"127.0.0.1:{port}"
    gateway, stub = stack.start_gateway(listen, wait_primary=False)  # the fallback stands in
    before = _fallbacks("primary_unavailable")
    response = stub.Generate(_request(8), timeout=30)
    assert response.model == FALLBACK
    assert response.fallback_reason.startswith(f"primary {PRIMARY} unavailable: no worker is ready")
    assert listen in response.fallback_reason
    assert list(response.token_ids) == stack.greedy(FALLBACK, stack.prompt_ids(), 8)
    assert _fallbacks("primary_unavailable") == before + 1
    (info,) = [
        m for m in stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models if m.name == PRIMARY
    ]
    assert (info.fallback_model, info.fallback_enabled, info.ready_workers) == (FALLBACK, True, 0)

    primary, first_return = _measure_return(stack, stub, listen)
    response = stub.Generate(_request(8), timeout=30)
    assert (response.model, response.fallback_reason) == (PRIMARY, "")
    assert list(response.token_ids) == stack.greedy(PRIMARY, stack.prompt_ids(), 8)

    stack.loop.run(primary.stop(0))
    response = wait_for(_served_by(stub, FALLBACK), WAIT_S, "the fallback took over")
    assert response.fallback_reason.startswith(f"primary {PRIMARY} unavailable: ")
    _, second_return = _measure_return(stack, stub, listen)
    print(f"primary served again {first_return:.2f} s and {second_return:.2f} s after it was ready")
    assert gateway.serving


def test_a_saturated_primary_sends_only_allow_fallback_requests_to_the_fallback(stack: Stack) -> None:
    primary = stack.start_primary(max_requests=2)
    primary.host.engine.engine.faults.set_step_delay(0.05)
    _, stub = stack.start_gateway(primary.address, max_queued_requests=2, ttft_slo_ms=0)
    long = _request(200, allow_fallback=False)
    running = [stub.GenerateStream(long, timeout=120) for _ in range(2)]
    for call in running:
        assert next(call).token_ids  # both worker credits are taken
    with ThreadPoolExecutor(2) as pool:
        queued = [pool.submit(stub.Generate, _request(4), timeout=120) for _ in range(2)]

        def queue_full() -> bool:
            models = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models
            return any(m.name == PRIMARY and m.queued_requests == 2 for m in models)

        wait_for(queue_full, WAIT_S, "two requests queued")
        before = _fallbacks("primary_saturated")
        served = stub.Generate(_request(6, allow_fallback=True), timeout=30)
        assert served.model == FALLBACK
        assert served.fallback_reason.startswith("primary saturated: queue full: 2 requests waiting")
        assert list(served.token_ids) == stack.greedy(FALLBACK, stack.prompt_ids(), 6)
        assert _fallbacks("primary_saturated") == before + 1
        for refused_request in (_request(4), _request(4, allow_fallback=True, no_fallback=True)):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(refused_request, timeout=30)
            assert time.monotonic() - started < 5.0
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            assert "queue full" in info.value.details()
            hint = retry_delay_s(dict(info.value.trailing_metadata() or ())[STATUS_DETAILS_KEY])
            assert hint is not None and hint > 0
        for call in running:
            call.cancel()
        assert [future.result(WAIT_S).model for future in queued] == [PRIMARY, PRIMARY]
    stack.crash(primary)


def test_a_failure_before_the_first_token_is_retried_on_the_fallback(stack: Stack) -> None:
    primary = stack.start_primary()
    _, stub = stack.start_gateway(primary.address)
    before = _fallbacks("primary_failed")
    primary.host.engine.engine.faults.fail_next_steps(1_000_000)  # simulated out of memory, every step
    response = stub.Generate(_request(8), timeout=60)
    primary.host.engine.engine.faults.fail_next_steps(0)
    assert response.model == FALLBACK
    assert response.fallback_reason.startswith("primary failed before the first token: ")
    assert "FINISH_REASON_ERROR" in response.fallback_reason
    assert list(response.token_ids) == stack.greedy(FALLBACK, stack.prompt_ids(), 8)
    assert response.failover_at_token == 0

    # A crash after the submission, before any token (each step takes 3 s).
    primary.host.engine.engine.faults.set_step_delay(3.0)
    with ThreadPoolExecutor(1) as pool:
        pending: Future[gateway_pb2.GenerateResponse] = pool.submit(stub.Generate, _request(8), timeout=60)
        wait_for(lambda: primary.host.credits.open == 1, WAIT_S, "the primary received the request")
        stack.crash(primary)
        response = pending.result(WAIT_S)
    assert response.model == FALLBACK
    assert response.fallback_reason.startswith(
        f"primary failed before the first token: worker {primary.address}"
    )
    assert list(response.token_ids) == stack.greedy(FALLBACK, stack.prompt_ids(), 8)
    assert _fallbacks("primary_failed") == before + 2


def _stream_until_crash(
    stack: Stack, stub: Any, request: gateway_pb2.GenerateRequest, primary: WorkerServer
) -> tuple[list[gateway_pb2.GenerateStreamResponse], Any]:
    """Read until the client holds a few tokens, then crash the primary; the rest is the caller's."""
    call = stub.GenerateStream(request, timeout=120)
    received: list[gateway_pb2.GenerateStreamResponse] = []
    while sum(len(m.token_ids) for m in received) < 6:
        received.append(next(call))
    stack.crash(primary)
    return received, call


def test_a_primary_dying_mid_stream_is_continued_by_the_fallback(stack: Stack) -> None:
    primary = stack.start_primary()
    primary.host.engine.engine.faults.set_step_delay(0.05)
    _, stub = stack.start_gateway(primary.address)
    before = _fallbacks("failover")
    total = 40
    # The primary repeats " France"; this stop string never matches, but the gateway holds back every
    # " France" it could begin, so at the failover the held-back text must carry over or be lost.
    request = _request(total, stop=(" France" * 9 + "\x07",), request_id="failover-1")
    messages, call = _stream_until_crash(stack, stub, request, primary)
    messages.extend(call)
    final = messages[-1].final
    ids = [token for message in messages for token in message.token_ids]
    prompt = stack.prompt_ids()
    cut = final.failover_at_token
    assert cut >= 6 and len(ids) == total == len(final.token_ids) == final.usage.output_tokens
    assert ids == list(final.token_ids)
    assert ids[:cut] == stack.greedy(PRIMARY, prompt, total)[:cut]
    assert ids[cut:] == stack.greedy(FALLBACK, prompt + ids[:cut], total - cut)
    assert (final.model, final.request_id, final.usage.input_tokens) == (FALLBACK, "failover-1", len(prompt))
    assert final.fallback_reason.startswith(
        f"primary {PRIMARY} failed mid-stream after {cut} tokens: worker "
    )
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert "".join(message.text for message in messages) == final.text == stack.text(ids)
    assert _fallbacks("failover") == before + 1


def test_a_failover_continues_every_sample_from_its_own_tokens(stack: Stack) -> None:
    primary = stack.start_primary()
    primary.host.engine.engine.faults.set_step_delay(0.05)
    _, stub = stack.start_gateway(primary.address)
    total = 30
    call = stub.GenerateStream(_request(total, request_id="failover-n", n=2), timeout=120)
    messages: list[gateway_pb2.GenerateStreamResponse] = []
    while min(sum(len(m.token_ids) for m in messages if m.index == i) for i in (0, 1)) < 3:
        messages.append(next(call))
    stack.crash(primary)
    messages.extend(call)
    prompt = stack.prompt_ids()
    finals = {m.index: m.final for m in messages[:-1] if m.HasField("final")}
    assert sorted(finals) == [0, 1] and len(messages[-1].final.choices) == 2
    for index, final in finals.items():
        ids = [t for m in messages[:-1] if m.index == index for t in m.token_ids]
        cut = final.failover_at_token
        assert cut >= 3 and ids == list(final.token_ids) and len(ids) == total
        assert ids[:cut] == stack.greedy(PRIMARY, prompt, total)[:cut]
        assert ids[cut:] == stack.greedy(FALLBACK, prompt + ids[:cut], total - cut)
        assert final.model == FALLBACK


@pytest.mark.parametrize("switch", ["no_fallback", "fallback_enabled_false"])
def test_without_fallback_a_dying_primary_ends_the_stream_saying_what_was_received(
    stack: Stack, switch: str
) -> None:
    primary = stack.start_primary()
    primary.host.engine.engine.faults.set_step_delay(0.05)
    route: dict[str, Any] = {"fallback_enabled": False} if switch == "fallback_enabled_false" else {}
    _, stub = stack.start_gateway(primary.address, **route)
    request = _request(40, no_fallback=switch == "no_fallback")
    messages, call = _stream_until_crash(stack, stub, request, primary)
    with pytest.raises(grpc.RpcError) as info:
        messages.extend(call)
    count = sum(len(message.token_ids) for message in messages)
    details = info.value.details()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, details
    assert f"model '{PRIMARY}' failed mid-stream after {count} tokens" in details
    assert details.endswith(f"the client received {count} tokens before the failure")
    assert ("no_fallback" if switch == "no_fallback" else "turned off") in details
    # A new request is not sent to the fallback either: the primary is down, so it is UNAVAILABLE.
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"model '{PRIMARY}'" in info.value.details() or "no worker is ready" in info.value.details()


def test_a_fallback_with_another_tokenizer_serves_new_requests_but_cannot_continue_a_stream(
    stack: Stack, other_tokenizer_dir: Path
) -> None:
    other = stack.start_worker(OTHER, other_tokenizer_dir)
    primary = stack.start_primary()
    primary.host.engine.engine.faults.set_step_delay(0.05)
    _, stub = stack.start_gateway(primary.address, fallback=other)
    fingerprints = {
        m.name: m.tokenizer_fingerprint for m in stub.ListModels(gateway_pb2.ListModelsRequest()).models
    }
    assert fingerprints[PRIMARY] != fingerprints[OTHER]
    messages, call = _stream_until_crash(stack, stub, _request(40), primary)
    with pytest.raises(grpc.RpcError) as info:
        messages.extend(call)
    count = sum(len(message.token_ids) for message in messages)
    details = info.value.details()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, details
    assert f"its fallback '{OTHER}' has another tokenizer" in details
    assert details.endswith(f"the client received {count} tokens before the failure")
    # A new request starts afresh, so the other tokenizer serves it (its own tokenization of the prompt).
    response = wait_for(_served_by(stub, OTHER), WAIT_S, "the other fallback took over")
    assert response.fallback_reason.startswith(f"primary {PRIMARY} unavailable: ")
    stack.loop.run(other.stop(0))
