"""The tokenizer service over real gRPC: in-process servers on ephemeral ports.

Tokenize is checked against the tokenizers library itself (and, on the real SmolLM2 model, against
transformers' apply_chat_template); Detokenize is driven the way the gateway drives it, one call per
engine step carrying every running request; errors are checked per entry and per call. The service
as a separate process (signals, exit codes, imports) is tests/integration/test_tokenizer_process.py's.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tokenizers import Tokenizer

from services.tokenizer.server import SERVICE_NAME, TokenizerServer, start
from services.tokenizer.settings import TokenizerSettings
from strata.fingerprint import tokenizer_fingerprint
from strata.v1 import common_pb2, gateway_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.tiny_tokenizer import write_tiny_tokenizer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from pathlib import Path

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
PROMPTS = [
    "Hello world!",
    "你好，世界。",
    "Emoji: 🙂🚀✨",
    " leading space",
    "The capital of France is Paris.",
]


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer without a chat template."""
    directory = write_tiny_tokenizer(tmp_path_factory.mktemp("plain-tokenizer"))
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    return directory


def settings_for(models: dict[str, Path], **extra: Any) -> TokenizerSettings:
    return TokenizerSettings.build(
        {"listen": "127.0.0.1:0", "models": {name: str(path) for name, path in models.items()}, **extra}
    )


@asynccontextmanager
async def serving(
    settings: TokenizerSettings,
) -> AsyncIterator[tuple[TokenizerServer, tokenizer_pb2_grpc.TokenizerServiceAsyncStub]]:
    server = await start(settings)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield server, tokenizer_pb2_grpc.TokenizerServiceStub(channel)  # type: ignore[misc]
    finally:
        await server.stop(grace=1.0)


def run(settings: TokenizerSettings, body: Callable[..., Awaitable[None]]) -> None:
    async def main() -> None:
        async with serving(settings) as (server, stub):
            await body(server, stub)

    asyncio.run(main())


def chat(*turns: tuple[str, str]) -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(role=role, content=content) for role, content in turns]


def test_tokenize_batch_matches_the_tokenizers_library(tiny_serving_dir: Path, plain_dir: Path) -> None:
    reference = Tokenizer.from_file(str(tiny_serving_dir / "tokenizer.json"))
    conversation = (("system", "Be brief."), ("user", "你好 🙂"))
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    entries = [tokenizer_pb2.TokenizeEntry(model="tiny", prompt=prompt) for prompt in PROMPTS]
    entries.insert(2, tokenizer_pb2.TokenizeEntry(model="tiny", messages=chat(*conversation)))
    entries.insert(4, tokenizer_pb2.TokenizeEntry(model="plain", prompt="Hello world!"))
    expected = [reference.encode(prompt).ids for prompt in PROMPTS]
    expected.insert(2, reference.encode(rendered, add_special_tokens=False).ids)
    expected.insert(4, reference.encode("Hello world!").ids)

    async def body(server: TokenizerServer, stub: Any) -> None:
        response = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(entries=entries))
        assert [list(r.token_ids) for r in response.results] == expected
        assert all(not r.HasField("error") and r.truncated_tokens == 0 for r in response.results)
        assert response.results[2].token_ids[0] == reference.token_to_id("<|im_start|>")

    run(settings_for({"tiny": tiny_serving_dir, "plain": plain_dir}), body)


def test_a_bad_entry_fails_alone_with_its_own_code(tiny_serving_dir: Path, plain_dir: Path) -> None:
    entries = [
        tokenizer_pb2.TokenizeEntry(model="missing", prompt="hi"),
        tokenizer_pb2.TokenizeEntry(model="tiny"),
        tokenizer_pb2.TokenizeEntry(model="tiny", messages=chat(("user", "a"), ("robot", "b"))),
        tokenizer_pb2.TokenizeEntry(model="tiny", messages=chat(("", "a"))),
        tokenizer_pb2.TokenizeEntry(model="plain", messages=chat(("user", "a"))),
        tokenizer_pb2.TokenizeEntry(model="tiny", prompt="hi", truncation=9),  # type: ignore[arg-type]
        tokenizer_pb2.TokenizeEntry(model="tiny", prompt="Hello world!"),
    ]

    async def body(server: TokenizerServer, stub: Any) -> None:
        results = (await stub.Tokenize(tokenizer_pb2.TokenizeRequest(entries=entries))).results
        codes = [r.error.code for r in results[:-1]]
        assert codes == [
            NOT_FOUND,
            INVALID_ARGUMENT,
            INVALID_ARGUMENT,
            INVALID_ARGUMENT,
            FAILED_PRECONDITION,
            INVALID_ARGUMENT,
        ]
        assert "'missing'" in results[0].error.message
        assert "plain, tiny" in results[0].error.message
        assert "prompt" in results[1].error.message
        assert "messages[1].role" in results[2].error.message
        assert "messages[0].role" in results[3].error.message
        assert "chat template" in results[4].error.message
        assert "truncation" in results[5].error.message
        assert all(not r.token_ids for r in results[:-1])
        assert not results[6].HasField("error")
        assert len(results[6].token_ids) > 0

    run(settings_for({"tiny": tiny_serving_dir, "plain": plain_dir}), body)


def test_truncation_refuses_or_keeps_the_end(tiny_serving_dir: Path) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    full = Tokenizer.from_file(str(tiny_serving_dir / "tokenizer.json")).encode(prompt).ids
    limit = len(full) - 10

    def entry(
        max_input_tokens: int, truncation: gateway_pb2.Truncation.ValueType
    ) -> tokenizer_pb2.TokenizeEntry:
        return tokenizer_pb2.TokenizeEntry(
            model="tiny", prompt=prompt, max_input_tokens=max_input_tokens, truncation=truncation
        )

    entries = [
        entry(limit, gateway_pb2.TRUNCATION_UNSPECIFIED),
        entry(limit, gateway_pb2.TRUNCATION_REFUSE),
        entry(limit, gateway_pb2.TRUNCATION_LEFT),
        entry(len(full), gateway_pb2.TRUNCATION_REFUSE),
        entry(0, gateway_pb2.TRUNCATION_REFUSE),
    ]

    async def body(server: TokenizerServer, stub: Any) -> None:
        results = (await stub.Tokenize(tokenizer_pb2.TokenizeRequest(entries=entries))).results
        for refused in results[:2]:
            assert refused.error.code == INVALID_ARGUMENT
            assert f"prompt is {len(full)} tokens" in refused.error.message
            assert f"at most {limit} input tokens" in refused.error.message
            assert "TRUNCATION_LEFT" in refused.error.message
        assert list(results[2].token_ids) == full[-limit:]
        assert results[2].truncated_tokens == 10
        for whole in results[3:]:
            assert list(whole.token_ids) == full
            assert whole.truncated_tokens == 0

    run(settings_for({"tiny": tiny_serving_dir}), body)


def test_a_batch_over_the_limit_is_refused_whole(tiny_serving_dir: Path) -> None:
    async def body(server: TokenizerServer, stub: Any) -> None:
        tokenize = tokenizer_pb2.TokenizeRequest(
            entries=[tokenizer_pb2.TokenizeEntry(model="tiny", prompt="hi")] * 5
        )
        detokenize = tokenizer_pb2.DetokenizeRequest(
            entries=[tokenizer_pb2.DetokenizeEntry(model="tiny", new_ids=[40])] * 5
        )
        for call, request in ((stub.Tokenize, tokenize), (stub.Detokenize, detokenize)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_batch_entries=4" in str(caught.value.details())
        del tokenize.entries[4]
        assert len((await stub.Tokenize(tokenize)).results) == 4

    run(settings_for({"tiny": tiny_serving_dir}, max_batch_entries=4), body)


def test_detokenize_serves_whole_engine_steps(tiny_serving_dir: Path) -> None:
    """Requests stream concurrently; each engine step is one call carrying every running request."""
    reference = Tokenizer.from_file(str(tiny_serving_dir / "tokenizer.json"))
    requests: list[tuple[str, list[str]]] = [
        ("你好，世界。今天天气很好。", []),
        ("Emoji: 🙂🚀✨ and accents: café", []),
        ("The quick brown fox jumps over the lazy dog.", ["lazy", "fox"]),
        ("Hello world! 🙂🚀 Strata streams tokens", ["🚀"]),
        ("def generate(prompt): return model(prompt)", ["return m"]),
        ("naïve Zürich 12345 67890", ["not there"]),
    ]
    ids = [reference.encode(text).ids for text, _ in requests]
    expected = []
    for (text, stops), request_ids in zip(requests, ids, strict=True):
        full = reference.decode(request_ids)
        assert full == text
        cuts = [full.find(stop) for stop in stops if stop in full]
        expected.append(full[: min(cuts)] if cuts else full)

    async def body(server: TokenizerServer, stub: Any) -> None:
        state: dict[int, tuple[list[int], int, str]] = {i: ([], 0, "") for i in range(len(requests))}
        position = dict.fromkeys(state, 0)
        texts = [""] * len(requests)
        stopped = [False] * len(requests)
        steps = 0
        while state:
            running = sorted(state)
            entries = []
            for i in running:
                window, read_offset, pending = state[i]
                size = 1 + (i + steps) % 3  # steps of 1 to 3 ids, as speculative steps may bring
                new_ids = ids[i][position[i] : position[i] + size]
                position[i] += size
                entries.append(
                    tokenizer_pb2.DetokenizeEntry(
                        model="tiny",
                        window=window,
                        read_offset=read_offset,
                        new_ids=new_ids,
                        pending_text=pending,
                        stop=requests[i][1],
                        final=position[i] >= len(ids[i]),
                    )
                )
            entries.append(tokenizer_pb2.DetokenizeEntry(model="gone", new_ids=[40]))
            response = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(entries=entries))
            assert len(response.results) == len(running) + 1
            assert response.results[-1].error.code == NOT_FOUND
            for i, entry, result in zip(running, entries, response.results, strict=False):
                assert not result.HasField("error")
                assert "\ufffd" not in result.text
                texts[i] += result.text
                if result.stopped or entry.final:
                    stopped[i] = result.stopped
                    del state[i]
                else:
                    state[i] = (list(result.window), result.read_offset, result.pending_text)
            steps += 1
        assert texts == expected
        assert stopped == [False, False, True, True, True, False]

    run(settings_for({"tiny": tiny_serving_dir}), body)


def test_info_health_and_reflection(tiny_serving_dir: Path, plain_dir: Path) -> None:
    eos = Tokenizer.from_file(str(tiny_serving_dir / "tokenizer.json")).token_to_id("<|im_end|>")

    async def body(server: TokenizerServer, stub: Any) -> None:
        info = await stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest())
        models = {model.name: model for model in info.models}
        assert set(models) == {"tiny", "plain"}
        assert models["tiny"].fingerprint == tokenizer_fingerprint(tiny_serving_dir)
        assert models["plain"].fingerprint == tokenizer_fingerprint(plain_dir)
        assert models["tiny"].fingerprint != models["plain"].fingerprint
        assert models["tiny"].has_chat_template
        assert not models["plain"].has_chat_template
        assert list(models["tiny"].eos_token_ids) == [eos]

        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

        def list_services() -> list[str]:
            with grpc.insecure_channel(server.address) as channel:
                return list(ProtoReflectionDescriptorDatabase(channel).get_services())

        assert SERVICE_NAME == "strata.v1.TokenizerService"
        assert SERVICE_NAME in await asyncio.to_thread(list_services)

    run(settings_for({"tiny": tiny_serving_dir, "plain": plain_dir}), body)


@pytest.mark.real_model
def test_chat_template_and_prompts_match_transformers(real_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(real_model_dir))
    conversations = [
        [("user", "What is the capital of France?")],
        [("system", "You answer in one word."), ("user", "你好 🙂")],
        [("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Tell me a joke.")],
    ]
    prompts = ["The capital of France is", " leading space and 🚀"]
    entries = [tokenizer_pb2.TokenizeEntry(model="smol", messages=chat(*turns)) for turns in conversations]
    entries += [tokenizer_pb2.TokenizeEntry(model="smol", prompt=prompt) for prompt in prompts]
    expected = [
        hf.apply_chat_template(
            [{"role": role, "content": content} for role, content in turns],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for turns in conversations
    ]
    expected += [hf(prompt)["input_ids"] for prompt in prompts]

    async def body(server: TokenizerServer, stub: Any) -> None:
        response = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(entries=entries))
        assert [list(r.token_ids) for r in response.results] == [list(ids) for ids in expected]
        info = await stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest())
        assert list(info.models[0].eos_token_ids) == [hf.eos_token_id]
        assert info.models[0].fingerprint == tokenizer_fingerprint(real_model_dir)

    run(settings_for({"smol": real_model_dir}), body)
