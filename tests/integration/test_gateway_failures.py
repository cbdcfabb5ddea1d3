"""What the gateway refuses and how its requests end early, end to end: bad fields, unknown models,
oversized and too long prompts, overload, cancellation, deadlines, a worker that is refused or lost,
and a gateway that stops. The real tokenizer service, workers and gateways, in-process on ephemeral
ports (conftest.py's gateway_env, plus the workers and gateways a test starts on its stack).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from typing import TYPE_CHECKING

import grpc
import pytest

from gateway.errors import STATUS_DETAILS_KEY, retry_delay_s
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.gateway_harness import CONTEXT, ENGINE, MAX_MESSAGE_BYTES, make_request
from tests.polling import wait_for

if TYPE_CHECKING:
    from pathlib import Path

    from tests.integration.gateway_harness import Env


INVALID: list[tuple[str, gateway_pb2.GenerateRequest]] = [
    ("prompt", gateway_pb2.GenerateRequest()),
    (
        "messages[0].role",
        gateway_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="robot", content="x")]),
    ),
    ("sampling.max_new_tokens", make_request(max_new_tokens=-3)),
    ("sampling.max_new_tokens", make_request(max_new_tokens=CONTEXT)),
    ("sampling.temperature", make_request(temperature=-1.0)),
    ("sampling.top_p", make_request(top_p=2.0)),
    ("sampling.top_k", make_request(top_k=-1)),
    ("sampling.repetition_penalty", make_request(repetition_penalty=-1.0)),
    ("sampling.no_repeat_ngram_size", make_request(no_repeat_ngram_size=-1)),
    ("sampling.stop", make_request(stop=["a"] * 9)),
    ("sampling.stop[0]", make_request(stop=["x" * 65])),
    ("request_id", gateway_pb2.GenerateRequest(prompt="hi", request_id="x" * 129)),
]


@pytest.mark.parametrize(("field", "request_"), INVALID, ids=[f"{i}-{f}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_fields_are_named(
    gateway_env: Env, field: str, request_: gateway_pb2.GenerateRequest
) -> None:
    for call in (
        gateway_env.gateway.Generate,
        lambda r, timeout: list(gateway_env.gateway.GenerateStream(r, timeout=timeout)),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call(request_, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(field), info.value.details()


def test_unknown_model_oversized_request_and_recovery(gateway_env: Env) -> None:
    with pytest.raises(grpc.RpcError) as info:
        gateway_env.gateway.Generate(gateway_pb2.GenerateRequest(prompt="hi", model="nope"), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "tiny" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        gateway_env.gateway.Generate(make_request("x" * (MAX_MESSAGE_BYTES + 1)), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    response = gateway_env.gateway.Generate(make_request(max_new_tokens=4, ignore_eos=True), timeout=60)
    assert len(response.token_ids) == 4


def test_prompt_too_long_is_refused_or_truncated_left(gateway_env: Env) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 40
    length = len(gateway_env.prompt_ids(prompt))
    assert length > CONTEXT
    with pytest.raises(grpc.RpcError) as info:
        gateway_env.gateway.Generate(make_request(prompt, max_new_tokens=16), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(length) in info.value.details() and str(CONTEXT - 16) in info.value.details()
    request = make_request(prompt, max_new_tokens=16, ignore_eos=True)
    request.truncation = gateway_pb2.TRUNCATION_LEFT
    response = gateway_env.gateway.Generate(request, timeout=60)
    assert response.usage.input_tokens == CONTEXT - 16
    assert response.usage.output_tokens == 16


def test_client_cancel_frees_the_kv_blocks(gateway_env: Env) -> None:
    stats = lambda: gateway_env.worker.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=10)  # noqa: E731
    wait_for(lambda: stats().used_kv_blocks == 0, 30, "the worker went idle")
    steps_before = stats().steps
    call = gateway_env.gateway.GenerateStream(
        make_request("Cancel me", max_new_tokens=230, ignore_eos=True), timeout=120
    )
    first = next(call)
    assert first.token_ids
    assert stats().used_kv_blocks > 0
    call.cancel()
    wait_for(lambda: stats().used_kv_blocks == 0 and stats().open_requests == 0, 30, "KV blocks freed")
    # Freed by the cancellation, not by running to the end: far fewer steps than 230 tokens need.
    assert stats().steps - steps_before < 200


def test_client_deadline_ends_the_request_everywhere(gateway_env: Env, tiny_serving_dir: Path) -> None:
    """A client deadline shorter than the generation: DEADLINE_EXCEEDED, and the worker frees the blocks."""
    slow = {**ENGINE, "enable_fault_injection": True}
    worker_address = gateway_env.stack.start_worker(tiny_serving_dir, engine=slow)
    worker_server = gateway_env.stack.servers[-1]
    worker_server.host.engine.engine.faults.set_step_delay(0.02)  # 200 tokens take >= 4 s
    gateway = gateway_env.stack.start_gateway(gateway_env.tokenizer_address, worker_address)
    stub = gateway_pb2_grpc.GatewayStub(gateway_env.stack.channel(gateway.address))
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as raised:
        stub.Generate(make_request("Too slow", max_new_tokens=200, ignore_eos=True), timeout=0.5)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3.0
    worker = worker_pb2_grpc.WorkerServiceStub(gateway_env.stack.channel(worker_address))
    stats = lambda: worker.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=10)  # noqa: E731
    wait_for(lambda: stats().used_kv_blocks == 0 and stats().open_requests == 0, 30, "KV blocks freed")
    assert stats().steps < 150  # ended by the deadline, not by running its 200 tokens


def test_worker_with_another_tokenizer_is_refused(
    gateway_env: Env, tiny_serving_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "tiny-other-tokenizer"
    shutil.copytree(tiny_serving_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["model_max_length"] = 255
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    stack = gateway_env.stack
    worker = stack.start_worker(other)
    gateway = stack.start_gateway(gateway_env.tokenizer_address, worker, wait=False)
    stub = gateway_pb2_grpc.GatewayStub(stack.channel(gateway.address))

    def refused() -> str:
        try:
            stub.Generate(make_request(max_new_tokens=2), timeout=30)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            return error.details() if "fingerprint" in error.details() else ""
        raise AssertionError("a gateway routed to a refusing worker answered")

    message = wait_for(refused, 30, "the refusal reached clients")
    assert "refused" in message
    assert not gateway.serving
    (model,) = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models
    assert (model.ready_workers, model.configured_workers) == (0, 1)


def test_overload_gets_a_retry_hint_and_a_lost_worker_fails_its_streams(gateway_env: Env) -> None:
    stack = gateway_env.stack
    worker = stack.start_worker(stack.model_dir, max_requests=2)
    # No queue: a request that finds no credit is refused at once.
    gateway = stack.start_gateway(gateway_env.tokenizer_address, worker, route={"max_queued_requests": 0})
    stub = gateway_pb2_grpc.GatewayStub(stack.channel(gateway.address))
    long = make_request("Keep going", max_new_tokens=230, ignore_eos=True)
    streams = [stub.GenerateStream(long, timeout=120) for _ in range(2)]
    for call in streams:
        assert next(call).token_ids
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(make_request(max_new_tokens=2), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    trailers = dict(info.value.trailing_metadata() or ())
    # The hint is the forecast wait: until a running stream's last token is due.
    hint = retry_delay_s(trailers[STATUS_DETAILS_KEY])
    assert hint is not None and 0 < hint < 120

    # Break the streams abruptly (no drain): the worker's gRPC server goes away under them.
    server = next(s for s in stack.servers if getattr(s, "address", None) == worker)
    stack.loop.run(server.running.server.stop(0))
    for call in streams:
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        assert worker in info.value.details()
    wait_for(lambda: not gateway.serving, 10, "the gateway NOT_SERVING without its worker")
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(make_request(max_new_tokens=2), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stop_lets_running_streams_finish(gateway_env: Env) -> None:
    gateway = gateway_env.stack.start_gateway(
        gateway_env.tokenizer_address, gateway_env.gateway_server.router.links()[0].address
    )
    stub = gateway_pb2_grpc.GatewayStub(gateway_env.stack.channel(gateway.address))
    call = stub.GenerateStream(make_request("Finish me", max_new_tokens=60, ignore_eos=True), timeout=120)
    first = next(call)
    stopping = asyncio.run_coroutine_threadsafe(gateway.stop(30), gateway_env.stack.loop.loop)
    rest = list(call)
    assert rest[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 60
    stopping.result(30)
    assert not gateway.serving
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(make_request(max_new_tokens=2), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
