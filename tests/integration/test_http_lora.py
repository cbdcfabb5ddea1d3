"""LoRA adapters through the gateway, with the official openai and anthropic SDKs and gRPC: loaded on the
route's workers by the gateway's admin endpoint, listed as `<model>:<adapter>`, requested by that name
or an alias, limited per tenant, refused when unknown, unloaded."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anthropic
import grpc
import httpx
import openai
import pytest

from strata.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.http_harness import KEY, MODEL, HttpStack
from tests.lora_adapters import write_adapter

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

ADMIN_KEY = "adapter-admin-key"
LIMITED_KEY = "limited-tenant-key"
WORKER_TOKEN = "worker-admin-token"


@pytest.fixture(scope="module")
def stack(
    tiny_serving_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[HttpStack, dict[str, Path]]]:
    root = tmp_path_factory.mktemp("http-adapters")
    adapters = {
        name: write_adapter(tiny_serving_dir, root / name, seed=seed) for name, seed in (("a", 31), ("b", 32))
    }
    limited = {"name": "limited", "api_keys": [LIMITED_KEY], "adapters": [f"{MODEL}:a"]}
    running = HttpStack(
        tiny_serving_dir,
        engine={"lora": {"max_loras": 2}},
        worker={"admin_token": WORKER_TOKEN},
        admin_keys=[ADMIN_KEY],
        worker_admin_token=WORKER_TOKEN,
        adapter_aliases={"support-bot": f"{MODEL}:b"},
        tenants=[{"name": "tight", "api_keys": ["http-tight-key"], "max_concurrent_requests": 1}, limited],
    )
    try:
        yield running, adapters
    finally:
        running.close()


def _admin(stack: HttpStack, path: str, body: dict[str, Any], key: str = ADMIN_KEY) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/{path}", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
    )


def _complete(client: openai.OpenAI, model: str) -> Any:
    return client.completions.create(model=model, prompt="abc", max_tokens=12, temperature=0)


def test_adapters_are_loaded_listed_served_and_unloaded(
    stack: tuple[HttpStack, dict[str, Path]], caplog: pytest.LogCaptureFixture
) -> None:
    """Loaded through the admin endpoint (a tenant's key is refused), listed by /v1/models and
    ListModels, served by name and alias (each adapter its own greedy text, the alias its adapter's),
    named in the response and the request log; unloaded, its name is 404."""
    running, adapters = stack
    client = openai.OpenAI(base_url=running.base_url, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert (
        _admin(
            running, "load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["a"])}, KEY
        ).status_code
        == 401
    )
    for name in ("a", "b"):
        answer = _admin(running, "load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[name])})
        assert answer.status_code == 200, answer.text
        assert [w["status"] for w in answer.json()["workers"]] == ["ok"]
    again = _admin(running, "load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["a"])})
    assert again.status_code == 409 and again.json()["workers"][0]["status"] == "already_exists"

    listed = {m.id: m for m in client.models.list()}
    assert set(listed) == {MODEL, f"{MODEL}:a", f"{MODEL}:b"}
    assert listed[f"{MODEL}:a"].model_extra == {"parent": MODEL, "root": str(adapters["a"]), "lora_rank": 8}
    grpc_models = gateway_pb2_grpc.GatewayStub(running.channel(running.gateway_address)).ListModels(
        gateway_pb2.ListModelsRequest(), metadata=[("authorization", f"Bearer {KEY}")], timeout=10
    )
    adapter_entries = {
        m.name: (m.base_model, m.adapter, m.lora_rank) for m in grpc_models.models if m.base_model
    }
    assert adapter_entries == {f"{MODEL}:a": (MODEL, "a", 8), f"{MODEL}:b": (MODEL, "b", 8)}

    with caplog.at_level(logging.INFO, logger="strata.requests"):
        texts = {
            model: _complete(client, model) for model in (MODEL, f"{MODEL}:a", f"{MODEL}:b", "support-bot")
        }
    assert {model: answer.model for model, answer in texts.items()} == {
        MODEL: MODEL,
        f"{MODEL}:a": f"{MODEL}:a",
        f"{MODEL}:b": f"{MODEL}:b",
        "support-bot": f"{MODEL}:b",
    }
    text = {model: answer.choices[0].text for model, answer in texts.items()}
    assert len({text[MODEL], text[f"{MODEL}:a"], text[f"{MODEL}:b"]}) == 3, "an adapter changed nothing"
    assert text["support-bot"] == text[f"{MODEL}:b"]
    fields = [getattr(record, "fields", {}) for record in caplog.records]
    logged = [(f["model"], f["adapter"]) for f in fields if f.get("event") == "request_finished"]
    assert (f"{MODEL}:a", "a") in logged and (MODEL, "") in logged

    messages = anthropic.Anthropic(base_url=running.origin, api_key=KEY, max_retries=0).messages.create(
        model=f"{MODEL}:a", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    assert messages.model == f"{MODEL}:a"

    assert _admin(running, "unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="'b' is not loaded"):
        _complete(client, f"{MODEL}:b")
    assert {m.id for m in client.models.list()} == {MODEL, f"{MODEL}:a"}
    assert _admin(running, "unload_lora_adapter", {"lora_name": "b"}).status_code == 404


def test_refusals_name_the_model_the_tenant_or_the_problem(
    stack: tuple[HttpStack, dict[str, Path]], tmp_path: Path
) -> None:
    running, adapters = stack
    client = openai.OpenAI(base_url=running.base_url, api_key=KEY, max_retries=0)
    _admin(running, "load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["a"])})
    with pytest.raises(openai.NotFoundError, match="'nope' is not loaded"):
        _complete(client, f"{MODEL}:nope")
    with pytest.raises(openai.NotFoundError, match="no route serves 'elsewhere:a'"):
        _complete(client, "elsewhere:a")
    limited = openai.OpenAI(base_url=running.base_url, api_key=LIMITED_KEY, max_retries=0)
    assert _complete(limited, f"{MODEL}:a").model == f"{MODEL}:a"
    assert _complete(limited, MODEL).model == MODEL
    with pytest.raises(openai.PermissionDeniedError, match="tenant 'limited' may not use adapter 'tiny:b'"):
        _complete(limited, "support-bot")
    (tmp_path / "empty").mkdir()
    broken = _admin(
        running, "load_lora_adapter", {"lora_name": "broken", "lora_path": str(tmp_path / "empty")}
    )
    assert broken.status_code == 400 and "no adapter_config.json" in broken.json()["workers"][0]["message"]
    unknown = httpx.post(f"{running.base_url}/load_lora_adapter", json={}, timeout=10)
    assert unknown.status_code == 401
    stub = gateway_pb2_grpc.GatewayStub(running.channel(running.gateway_address))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(
            gateway_pb2.GenerateRequest(model=f"{MODEL}:b", prompt="x"),
            metadata=[("authorization", f"Bearer {LIMITED_KEY}")],
            timeout=30,
        )
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert running.idle()
