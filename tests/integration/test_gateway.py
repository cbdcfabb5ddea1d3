"""The gateway end to end: the real tokenizer service, a real worker and the gateway, in-process on
ephemeral ports.

The servers run on one event loop in a background thread (started once per module); the tests call
them with ordinary blocking gRPC clients, the way any client would.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.errors import STATUS_DETAILS_KEY, retry_delay_s
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.params import SamplingParams
from strata.fingerprint import tokenizer_fingerprint
from strata.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.integration.loop_thread import LoopThread

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

from tests.integration.gateway_harness import (
    CONTEXT,
    ENGINE,
    MAX_MESSAGE_BYTES,
    Env,
    Stack,
    make_request,
)
from tests.polling import wait_for


@pytest.fixture(scope="module")
def env(tiny_serving_dir: Path) -> Iterator[Env]:
    loop = LoopThread()
    stack = Stack(loop, tiny_serving_dir)
    try:
        tokenizer = stack.start_tokenizer()
        worker = stack.start_worker(tiny_serving_dir)
        gateway = stack.start_gateway(tokenizer, worker)
        yield Env(stack, gateway, tokenizer, worker)
    finally:
        stack.close()
        loop.close()


def test_generate_answers_with_text_usage_timing_and_ids(env: Env) -> None:
    response = env.gateway.Generate(make_request(max_new_tokens=16, ignore_eos=True), timeout=60)
    assert response.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(response.token_ids) == 16
    assert response.usage.output_tokens == 16
    assert response.usage.input_tokens == len(env.prompt_ids("Hello world"))
    assert response.text and response.model == "tiny" and response.fallback_reason == ""
    assert len(response.request_id) == 32 and int(response.request_id, 16) >= 0
    timing = response.timing
    assert timing.preprocess_ms > 0 and timing.forward_ms > 0 and timing.decode_ms > 0
    assert 0 < timing.time_to_first_token_ms <= timing.total_ms


def test_stream_deltas_add_up_to_the_final_answer(env: Env) -> None:
    request = make_request("The capital of France", max_new_tokens=24, ignore_eos=True)
    request.request_id = "my-request"
    messages = list(env.gateway.GenerateStream(request, timeout=60))
    assert len(messages) >= 2
    final = messages[-1].final
    assert all(not m.HasField("final") for m in messages[:-1])
    assert "".join(m.text for m in messages) == final.text
    assert [t for m in messages for t in m.token_ids] == list(final.token_ids)
    assert final.usage.output_tokens == 24 and len(final.token_ids) == 24
    assert final.request_id == "my-request"
    unary = env.gateway.Generate(request, timeout=60)
    assert (unary.text, list(unary.token_ids)) == (final.text, list(final.token_ids))


def test_chat_messages_use_the_chat_template(env: Env) -> None:
    request = gateway_pb2.GenerateRequest(
        messages=[
            common_pb2.ChatMessage(role="system", content="Be brief."),
            common_pb2.ChatMessage(role="user", content="What is the capital of France?"),
        ],
        sampling=common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True),
    )
    response = env.gateway.Generate(request, timeout=60)
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert response.usage.input_tokens == len(env.prompt_ids(rendered))
    assert response.usage.output_tokens == 8


def test_stop_string_cuts_the_text_where_it_begins(env: Env) -> None:
    first = env.gateway.Generate(
        make_request("Tell me a story", max_new_tokens=40, ignore_eos=True), timeout=60
    )
    text = first.text
    start = len(text) // 2
    stop = text[start : start + 3]
    assert len(stop.strip()) > 0, f"pick another stop string from {text!r}"
    expected = text[: text.index(stop)]
    stopped = env.gateway.Generate(
        make_request("Tell me a story", max_new_tokens=40, ignore_eos=True, stop=[stop]), timeout=60
    )
    assert stopped.finish_reason == common_pb2.FINISH_REASON_STOP
    assert stopped.text == expected
    assert len(stopped.token_ids) < 40
    assert list(stopped.token_ids) == list(first.token_ids[: len(stopped.token_ids)])
    streamed = list(
        env.gateway.GenerateStream(
            make_request("Tell me a story", max_new_tokens=40, ignore_eos=True, stop=[stop]), timeout=60
        )
    )
    assert "".join(m.text for m in streamed) == expected == streamed[-1].final.text


def test_list_models_reports_the_route(env: Env, tiny_serving_dir: Path) -> None:
    answer = env.gateway.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
    assert answer.default_model == "tiny"
    (model,) = answer.models
    assert (model.name, model.max_model_len, model.ready_workers, model.configured_workers) == (
        "tiny",
        CONTEXT,
        1,
        1,
    )
    assert model.tokenizer_fingerprint == tokenizer_fingerprint(tiny_serving_dir)
    assert model.fallback_model == ""


def test_reflection_and_health(env: Env) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(env.gateway_channel)
    (answer,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {service.name for service in answer.list_services_response.service}
    assert {"strata.v1.Gateway", "grpc.health.v1.Health"} <= names
    health = health_pb2_grpc.HealthStub(env.gateway_channel)
    for service in ("", "strata.v1.Gateway"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_concurrent_streams_match_the_engine_alone(env: Env, tiny_serving_dir: Path) -> None:
    prompts = [f"Request {i}: the quick brown fox number {i * 7}" for i in range(32)]
    new_tokens = 12

    def stream(prompt: str) -> list[int]:
        messages = env.gateway.GenerateStream(
            make_request(prompt, max_new_tokens=new_tokens, ignore_eos=True), timeout=120
        )
        return [t for m in messages for t in m.token_ids]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(stream, prompts))
    engine = LLMEngine.from_model_dir(tiny_serving_dir, EngineConfig.model_validate(ENGINE))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for prompt, tokens in zip(prompts, got, strict=True):
        (alone,) = engine.generate([env.prompt_ids(prompt)], params)
        assert tokens == alone, prompt


def test_hundreds_of_concurrent_streams_all_complete(env: Env, tiny_serving_dir: Path) -> None:
    """256 streams at once on one asyncio channel: every one gets its tokens, its final message agrees
    with its deltas, a stream's tokens equal a unary call's for the same prompt, and no KV block leaks."""
    engine = {"num_blocks": 512, "max_num_seqs": 64, "max_num_batched_tokens": 512}
    worker = env.stack.start_worker(tiny_serving_dir, max_requests=256, engine=engine)
    # No TTFT SLO: the forecast would rightly refuse part of a 256-stream burst on a slow machine, and
    # this test is about every admitted stream completing, not about admission.
    gateway = env.stack.start_gateway(env.tokenizer_address, worker, route={"ttft_slo_ms": 0})
    count, new_tokens = 256, 8

    async def run_all() -> list[tuple[list[int], str, gateway_pb2.GenerateResponse]]:
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            async def one(i: int) -> tuple[list[int], str, gateway_pb2.GenerateResponse]:
                ids: list[int] = []
                text: list[str] = []
                final = gateway_pb2.GenerateResponse()
                request = make_request(f"stream {i} of many", max_new_tokens=new_tokens, ignore_eos=True)
                async for message in stub.GenerateStream(request, timeout=300):
                    ids.extend(message.token_ids)
                    text.append(message.text)
                    if message.HasField("final"):
                        final = message.final
                return ids, "".join(text), final

            return await asyncio.gather(*(one(i) for i in range(count)))

    results = asyncio.run(run_all())
    assert len(results) == count
    for ids, text, final in results:
        assert len(ids) == new_tokens and list(final.token_ids) == ids
        assert final.text == text and final.usage.output_tokens == new_tokens
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    gateway_stub = gateway_pb2_grpc.GatewayStub(env.stack.channel(gateway.address))
    for i in (0, 97, 255):
        unary = gateway_stub.Generate(
            make_request(f"stream {i} of many", max_new_tokens=new_tokens, ignore_eos=True), timeout=60
        )
        assert list(unary.token_ids) == results[i][0]
    worker_stub = worker_pb2_grpc.WorkerServiceStub(env.stack.channel(worker))
    wait_for(
        lambda: (
            worker_stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=10).used_kv_blocks == 0
        ),
        30,
        "the worker freed every KV block",
    )


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
def test_invalid_fields_are_named(env: Env, field: str, request_: gateway_pb2.GenerateRequest) -> None:
    for call in (
        env.gateway.Generate,
        lambda r, timeout: list(env.gateway.GenerateStream(r, timeout=timeout)),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call(request_, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(field), info.value.details()


def test_unknown_model_oversized_request_and_recovery(env: Env) -> None:
    with pytest.raises(grpc.RpcError) as info:
        env.gateway.Generate(gateway_pb2.GenerateRequest(prompt="hi", model="nope"), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "tiny" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        env.gateway.Generate(make_request("x" * (MAX_MESSAGE_BYTES + 1)), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    response = env.gateway.Generate(make_request(max_new_tokens=4, ignore_eos=True), timeout=60)
    assert len(response.token_ids) == 4


def test_prompt_too_long_is_refused_or_truncated_left(env: Env) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 40
    length = len(env.prompt_ids(prompt))
    assert length > CONTEXT
    with pytest.raises(grpc.RpcError) as info:
        env.gateway.Generate(make_request(prompt, max_new_tokens=16), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(length) in info.value.details() and str(CONTEXT - 16) in info.value.details()
    request = make_request(prompt, max_new_tokens=16, ignore_eos=True)
    request.truncation = gateway_pb2.TRUNCATION_LEFT
    response = env.gateway.Generate(request, timeout=60)
    assert response.usage.input_tokens == CONTEXT - 16
    assert response.usage.output_tokens == 16


def test_client_cancel_frees_the_kv_blocks(env: Env) -> None:
    stats = lambda: env.worker.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=10)  # noqa: E731
    wait_for(lambda: stats().used_kv_blocks == 0, 30, "the worker went idle")
    steps_before = stats().steps
    call = env.gateway.GenerateStream(
        make_request("Cancel me", max_new_tokens=230, ignore_eos=True), timeout=120
    )
    first = next(call)
    assert first.token_ids
    assert stats().used_kv_blocks > 0
    call.cancel()
    wait_for(lambda: stats().used_kv_blocks == 0 and stats().open_requests == 0, 30, "KV blocks freed")
    # Freed by the cancellation, not by running to the end: far fewer steps than 230 tokens need.
    assert stats().steps - steps_before < 200


def test_client_deadline_ends_the_request_everywhere(env: Env, tiny_serving_dir: Path) -> None:
    """A client deadline shorter than the generation: DEADLINE_EXCEEDED, and the worker frees the blocks."""
    slow = {**ENGINE, "enable_fault_injection": True}
    worker_address = env.stack.start_worker(tiny_serving_dir, engine=slow)
    worker_server = env.stack.servers[-1]
    worker_server.host.engine.engine.faults.set_step_delay(0.02)  # 200 tokens take >= 4 s
    gateway = env.stack.start_gateway(env.tokenizer_address, worker_address)
    stub = gateway_pb2_grpc.GatewayStub(env.stack.channel(gateway.address))
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as raised:
        stub.Generate(make_request("Too slow", max_new_tokens=200, ignore_eos=True), timeout=0.5)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3.0
    worker = worker_pb2_grpc.WorkerServiceStub(env.stack.channel(worker_address))
    stats = lambda: worker.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=10)  # noqa: E731
    wait_for(lambda: stats().used_kv_blocks == 0 and stats().open_requests == 0, 30, "KV blocks freed")
    assert stats().steps < 150  # ended by the deadline, not by running its 200 tokens


def test_worker_with_another_tokenizer_is_refused(env: Env, tiny_serving_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "tiny-other-tokenizer"
    shutil.copytree(tiny_serving_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["model_max_length"] = 255
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    stack = env.stack
    worker = stack.start_worker(other)
    gateway = stack.start_gateway(env.tokenizer_address, worker, wait=False)
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


def test_overload_gets_a_retry_hint_and_a_lost_worker_fails_its_streams(env: Env) -> None:
    stack = env.stack
    worker = stack.start_worker(stack.model_dir, max_requests=2)
    # No queue: a request that finds no credit is refused at once.
    gateway = stack.start_gateway(env.tokenizer_address, worker, route={"max_queued_requests": 0})
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


def test_stop_lets_running_streams_finish(env: Env) -> None:
    gateway = env.stack.start_gateway(env.tokenizer_address, env.gateway_server.router.links()[0].address)
    stub = gateway_pb2_grpc.GatewayStub(env.stack.channel(gateway.address))
    call = stub.GenerateStream(make_request("Finish me", max_new_tokens=60, ignore_eos=True), timeout=120)
    first = next(call)
    stopping = asyncio.run_coroutine_threadsafe(gateway.stop(30), env.stack.loop.loop)
    rest = list(call)
    assert rest[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 60
    stopping.result(30)
    assert not gateway.serving
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(make_request(max_new_tokens=2), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
