"""The worker's LoRA adapters over gRPC: served from the start and loaded at run time by its admin,
each submission through its adapter equal to PEFT's merged model, refusals with the right codes."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from strata.v1 import worker_pb2
from tests.integration.worker_harness import ENGINE, connect, running_worker, submission
from tests.lora_adapters import base_model, merged_model, write_adapter
from tests.parity import assert_greedy_parity, hf_greedy_reference

if TYPE_CHECKING:
    from pathlib import Path

TOKEN = "admin-secret"
ADMIN = (("authorization", f"Bearer {TOKEN}"),)
PROMPT = [5, 9, 14, 3, 22]
NEW_TOKENS = 10
LORA_ENGINE: dict[str, Any] = {**ENGINE, "lora": {"max_loras": 2}}


@pytest.fixture(scope="module")
def adapters(tiny_serving_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("worker-adapters")
    return {
        name: write_adapter(tiny_serving_dir, root / name, seed=seed) for name, seed in (("a", 21), ("b", 22))
    }


def _code(error: pytest.ExceptionInfo[grpc.aio.AioRpcError]) -> grpc.StatusCode:
    return error.value.code()


def test_adapters_served_and_managed_over_grpc(
    tiny_serving_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """a from the settings, b loaded by the admin: one stream's submissions through a, b and the base
    each give their merged (or base) model's greedy tokens; ListAdapters names both; unloaded, b is
    NOT_FOUND; admin calls without the token are UNAUTHENTICATED and a broken adapter INVALID_ARGUMENT."""

    async def scenario() -> dict[str, list[int]]:
        settings = {"engine": LORA_ENGINE, "adapters": {"a": str(adapters["a"])}, "admin_token": TOKEN}
        async with running_worker(tiny_serving_dir, **settings) as (_, stub):
            listed = await stub.ListAdapters(worker_pb2.ListAdaptersRequest())
            assert [a.name for a in listed.adapters] == ["a"] and listed.max_loras == 2
            request = worker_pb2.LoadAdapterRequest(name="b", path=str(adapters["b"]))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.LoadAdapter(request)
            assert _code(refused) == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.LoadAdapter(request, metadata=(("authorization", "Bearer wrong"),))
            assert _code(refused) == grpc.StatusCode.UNAUTHENTICATED
            loaded = await stub.LoadAdapter(request, metadata=ADMIN)
            assert (loaded.adapter.name, loaded.adapter.rank) == ("b", 8)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.LoadAdapter(request, metadata=ADMIN)
            assert _code(refused) == grpc.StatusCode.ALREADY_EXISTS
            (tmp_path / "broken").mkdir()
            broken = worker_pb2.LoadAdapterRequest(name="broken", path=str(tmp_path / "broken"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.LoadAdapter(broken, metadata=ADMIN)
            assert _code(refused) == grpc.StatusCode.INVALID_ARGUMENT
            assert "no adapter_config.json" in (refused.value.details() or "")
            listed = await stub.ListAdapters(worker_pb2.ListAdaptersRequest())
            assert [a.name for a in listed.adapters] == ["a", "b"]

            side = await connect(stub, tiny_serving_dir)
            for name in ("", "a", "b"):
                sampling = {"ignore_eos": True}
                await side.send(
                    submission(f"via-{name}", PROMPT, NEW_TOKENS, sampling=sampling, adapter=name)
                )
            await side.send(submission("unknown", PROMPT, NEW_TOKENS, adapter="nope"))
            await side.read_until(
                lambda s: {"via-", "via-a", "via-b"} <= set(s.finals) and "unknown" in s.rejections
            )
            assert side.rejections["unknown"].code == grpc.StatusCode.NOT_FOUND.value[0]
            assert "'nope' is not loaded" in side.rejections["unknown"].message

            await stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name="b"), metadata=ADMIN)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name="b"), metadata=ADMIN)
            assert _code(refused) == grpc.StatusCode.NOT_FOUND
            await side.send(submission("after-unload", PROMPT, NEW_TOKENS, adapter="b"))
            await side.read_until(lambda s: "after-unload" in s.rejections)
            assert side.rejections["after-unload"].code == grpc.StatusCode.NOT_FOUND.value[0]
            return {name: side.tokens[f"via-{name}"] for name in ("", "a", "b")}

    tokens = asyncio.run(scenario())
    references = {
        "": base_model(tiny_serving_dir),
        **{n: merged_model(tiny_serving_dir, p) for n, p in adapters.items()},
    }
    for name, reference in references.items():
        ref, logits = hf_greedy_reference(reference, PROMPT, NEW_TOKENS)
        assert_greedy_parity(tokens[name], ref, logits, context=f"adapter {name!r}")


def test_a_worker_without_an_admin_token_refuses_admin_calls(
    tiny_serving_dir: Path, adapters: dict[str, Path]
) -> None:
    async def scenario() -> None:
        async with running_worker(tiny_serving_dir, engine=LORA_ENGINE) as (_, stub):
            request = worker_pb2.LoadAdapterRequest(name="a", path=str(adapters["a"]))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.LoadAdapter(request, metadata=ADMIN)
            assert _code(refused) == grpc.StatusCode.PERMISSION_DENIED
            assert "admin_token" in (refused.value.details() or "")

    asyncio.run(scenario())


def test_adapters_at_start_need_slots(tiny_serving_dir: Path, adapters: dict[str, Path]) -> None:
    from strata.settings import SettingsError
    from tests.integration.worker_harness import worker_settings

    with pytest.raises(SettingsError, match=r"adapters a need adapter slots: set engine\.lora\.max_loras"):
        worker_settings(tiny_serving_dir, adapters={"a": str(adapters["a"])})
