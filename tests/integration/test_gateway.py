"""The gateway end to end serving requests: the real tokenizer service, a real worker and the gateway,
in-process on ephemeral ports (conftest.py's gateway_env).

The servers run on one event loop in a background thread (started once per module); the tests call
them with ordinary blocking gRPC clients, the way any client would. What the gateway refuses and how
requests end early is test_gateway_failures.py's.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from strata.fingerprint import tokenizer_fingerprint
from strata.sampling import SamplingParams
from strata.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.integration.gateway_harness import CONTEXT, ENGINE, make_request
from tests.polling import wait_for

if TYPE_CHECKING:
    from pathlib import Path

    from tests.integration.gateway_harness import Env


def test_generate_answers_with_text_usage_timing_and_ids(gateway_env: Env) -> None:
    response = gateway_env.gateway.Generate(make_request(max_new_tokens=16, ignore_eos=True), timeout=60)
    assert response.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(response.token_ids) == 16
    assert response.usage.output_tokens == 16
    assert response.usage.input_tokens == len(gateway_env.prompt_ids("Hello world"))
    assert response.text and response.model == "tiny" and response.fallback_reason == ""
    assert len(response.request_id) == 32 and int(response.request_id, 16) >= 0
    timing = response.timing
    assert timing.preprocess_ms > 0 and timing.forward_ms > 0 and timing.decode_ms > 0
    assert 0 < timing.time_to_first_token_ms <= timing.total_ms


def test_stream_deltas_add_up_to_the_final_answer(gateway_env: Env) -> None:
    request = make_request("The capital of France", max_new_tokens=24, ignore_eos=True)
    request.request_id = "my-request"
    messages = list(gateway_env.gateway.GenerateStream(request, timeout=60))
    assert len(messages) >= 2
    final = messages[-1].final
    assert all(not m.HasField("final") for m in messages[:-1])
    assert "".join(m.text for m in messages) == final.text
    assert [t for m in messages for t in m.token_ids] == list(final.token_ids)
    assert final.usage.output_tokens == 24 and len(final.token_ids) == 24
    assert final.request_id == "my-request"
    unary = gateway_env.gateway.Generate(request, timeout=60)
    assert (unary.text, list(unary.token_ids)) == (final.text, list(final.token_ids))


def test_chat_messages_use_the_chat_template(gateway_env: Env) -> None:
    request = gateway_pb2.GenerateRequest(
        messages=[
            common_pb2.ChatMessage(role="system", content="Be brief."),
            common_pb2.ChatMessage(role="user", content="What is the capital of France?"),
        ],
        sampling=common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True),
    )
    response = gateway_env.gateway.Generate(request, timeout=60)
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert response.usage.input_tokens == len(gateway_env.prompt_ids(rendered))
    assert response.usage.output_tokens == 8


def test_stop_string_cuts_the_text_where_it_begins(gateway_env: Env) -> None:
    first = gateway_env.gateway.Generate(
        make_request("Tell me a story", max_new_tokens=40, ignore_eos=True), timeout=60
    )
    text = first.text
    start = len(text) // 2
    stop = text[start : start + 3]
    assert len(stop.strip()) > 0, f"pick another stop string from {text!r}"
    expected = text[: text.index(stop)]
    # The final names the stop string that matched, not merely one of the request's.
    stops = ["\x07never", stop]
    stopped = gateway_env.gateway.Generate(
        make_request("Tell me a story", max_new_tokens=40, ignore_eos=True, stop=stops), timeout=60
    )
    assert stopped.finish_reason == common_pb2.FINISH_REASON_STOP
    assert stopped.text == expected
    assert stopped.stop_sequence == stop
    assert len(stopped.token_ids) < 40
    assert list(stopped.token_ids) == list(first.token_ids[: len(stopped.token_ids)])
    streamed = list(
        gateway_env.gateway.GenerateStream(
            make_request("Tell me a story", max_new_tokens=40, ignore_eos=True, stop=stops), timeout=60
        )
    )
    assert "".join(m.text for m in streamed) == expected == streamed[-1].final.text
    assert streamed[-1].final.stop_sequence == stop
    # Ended by length, with stop strings that never matched: no stop string to name.
    assert first.finish_reason == common_pb2.FINISH_REASON_LENGTH and first.stop_sequence == ""
    unmatched = gateway_env.gateway.Generate(
        make_request("Tell me a story", max_new_tokens=40, ignore_eos=True, stop=["\x07never"]), timeout=60
    )
    assert unmatched.finish_reason == common_pb2.FINISH_REASON_LENGTH and unmatched.stop_sequence == ""


def test_list_models_reports_the_route(gateway_env: Env, tiny_serving_dir: Path) -> None:
    answer = gateway_env.gateway.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
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


def test_reflection_and_health(gateway_env: Env) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(gateway_env.gateway_channel)
    (answer,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {service.name for service in answer.list_services_response.service}
    assert {"strata.v1.Gateway", "grpc.health.v1.Health"} <= names
    health = health_pb2_grpc.HealthStub(gateway_env.gateway_channel)
    for service in ("", "strata.v1.Gateway"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_concurrent_streams_match_the_engine_alone(gateway_env: Env, tiny_serving_dir: Path) -> None:
    prompts = [f"Request {i}: the quick brown fox number {i * 7}" for i in range(32)]
    new_tokens = 12

    def stream(prompt: str) -> list[int]:
        messages = gateway_env.gateway.GenerateStream(
            make_request(prompt, max_new_tokens=new_tokens, ignore_eos=True), timeout=120
        )
        return [t for m in messages for t in m.token_ids]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(stream, prompts))
    engine = LLMEngine.from_model_dir(tiny_serving_dir, EngineConfig.model_validate(ENGINE))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for prompt, tokens in zip(prompts, got, strict=True):
        (alone,) = engine.generate([gateway_env.prompt_ids(prompt)], params)
        assert tokens == alone, prompt


def test_hundreds_of_concurrent_streams_all_complete(gateway_env: Env, tiny_serving_dir: Path) -> None:
    """256 streams at once on one asyncio channel: every one gets its tokens, its final message agrees
    with its deltas, a stream's tokens equal a unary call's for the same prompt, and no KV block leaks."""
    engine = {"num_blocks": 512, "max_num_seqs": 64, "max_num_batched_tokens": 512}
    worker = gateway_env.stack.start_worker(tiny_serving_dir, max_requests=256, engine=engine)
    gateway = gateway_env.stack.start_gateway(gateway_env.tokenizer_address, worker)
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
    gateway_stub = gateway_pb2_grpc.GatewayStub(gateway_env.stack.channel(gateway.address))
    for i in (0, 97, 255):
        unary = gateway_stub.Generate(
            make_request(f"stream {i} of many", max_new_tokens=new_tokens, ignore_eos=True), timeout=60
        )
        assert list(unary.token_ids) == results[i][0]
    worker_stub = worker_pb2_grpc.WorkerServiceStub(gateway_env.stack.channel(worker))
    wait_for(
        lambda: (
            worker_stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=10).used_kv_blocks == 0
        ),
        30,
        "the worker freed every KV block",
    )
