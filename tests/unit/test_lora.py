"""LoRA adapters over one base model: each adapter's rows equal PEFT's merged model, in mixed batches.

Adapters are made by PEFT itself with random A and B (tests/lora_adapters.py), so an adapter that were
ignored, misplaced in a fused projection or scaled wrongly would change the logits. The reference is
transformers' model with PEFT's merge of the adapter; ours never merges: it adds each row's delta
beside the base projection, through the native kernel or torch, in the per-operator path and in the
native decode stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

from services.worker.model import native
from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import load_model
from services.worker.model.lora import LoraSlots
from services.worker.model.lora_file import read_adapter
from tests.lora_adapters import (
    ALL_MODULES,
    NEW_TOKENS,
    base_model,
    lora_engine,
    merged_model,
    prompts,
    run_requests,
    write_adapter,
)
from tests.parity import assert_greedy_parity, assert_logits_close, hf_greedy_reference

if TYPE_CHECKING:
    from pathlib import Path

PHI3_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of the tiny Llama: every module at rank 8, and q/v only at rank 4 with rsLoRA."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": write_adapter(tiny_llama_dir, root / "a", seed=1),
        "b": write_adapter(
            tiny_llama_dir, root / "b", seed=2, rank=4, modules=("q_proj", "v_proj"), use_rslora=True
        ),
    }


def _prefill(model: Any, ids: torch.Tensor) -> torch.Tensor:
    cache = KVCache.allocate(model.config, 16, 4, torch.float32, "cpu")
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(8))], 4, "cpu", 0)
    logits: torch.Tensor = model.compute_logits(model(ids, torch.arange(len(ids)), meta, cache))
    return logits


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize(
    ("fixture", "modules"),
    [
        ("tiny_llama_dir", None),
        ("tiny_qwen2_dir", None),
        ("tiny_gemma3_dir", None),
        ("tiny_phi3_dir", PHI3_MODULES),
    ],
)
def test_prefill_logits_equal_the_merged_model(
    fixture: str,
    modules: tuple[str, ...] | None,
    kernels: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """A prompt through slot 1 gives the merged model's logits, through slot -1 the base's, in one model."""
    base_dir = request.getfixturevalue(fixture)
    adapter = write_adapter(base_dir, tmp_path / "adapter", seed=3, modules=modules or ALL_MODULES)
    ids = torch.randint(0, 384, (11,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = merged_model(base_dir, adapter)(ids[None]).logits[0]
    ours = load_model(base_dir).model
    slots = LoraSlots(ours.config, 2, 16, torch.device("cpu"), torch.float32)
    slots.install(1, read_adapter("adapter", adapter, ours.config, 16))
    ours.attach_lora(slots)
    previous = native.set_enabled(kernels == "native")
    try:
        with torch.inference_mode():
            slots.set_rows([1] * len(ids))
            got = _prefill(ours, ids)
            slots.set_rows(None)
            base = _prefill(ours, ids)
    finally:
        native.set_enabled(previous)
    assert_logits_close(got, expected, context=f"{fixture} through its adapter")
    assert (base - expected).abs().max() > 1e-2, "the adapter changed nothing: the test would prove nothing"


@pytest.mark.parametrize("count", [6, 12], ids=["decode-stack", "per-operator"])
def test_a_mixed_batch_serves_each_adapter_as_its_merged_model(
    count: int, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """Base rows and two adapters' rows share every step; each request's greedy tokens are those of
    transformers on its merged model (6 rows decode in the native stack, 12 layer by layer)."""
    engine = lora_engine(tiny_llama_dir, max_loras=2)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    names = ["", "a", "b"]
    requests = [(f"r{i}", prompt, names[i % 3]) for i, prompt in enumerate(prompts(count))]
    mixed: list[int] = []
    tokens = run_requests(
        engine, requests, lambda e: mixed.append(len({s.adapter for s in e.scheduler.running}))
    )
    assert max(mixed) == 3, "the three kinds of rows never ran in one step"
    references = {
        "": base_model(tiny_llama_dir),
        **{n: merged_model(tiny_llama_dir, p) for n, p in adapters.items()},
    }
    for request_id, prompt, adapter in requests:
        ref, ref_logits = hf_greedy_reference(references[adapter], prompt, NEW_TOKENS)
        assert_greedy_parity(tokens[request_id], ref, ref_logits, context=f"{request_id} adapter {adapter!r}")


@pytest.mark.real_model
def test_the_default_model_through_an_adapter_equals_peft_merged(
    real_model_dir: Path, tmp_path: Path
) -> None:
    """SmolLM2-135M with a random rank-8 adapter of every projection: base and adapter requests in one
    batch each give transformers' greedy tokens on the base and on PEFT's merged model."""
    adapter = write_adapter(real_model_dir, tmp_path / "adapter", seed=7, rank=8, alpha=2)
    engine = lora_engine(real_model_dir, max_loras=1)
    engine.load_adapter("a", adapter)
    prompt = [1, 504, 3458, 314, 260, 1345, 282]
    requests = [("base", prompt, ""), ("through", prompt, "a")]
    tokens = run_requests(engine, requests)
    assert tokens["through"] != tokens["base"], "the adapter changed nothing: the test would prove nothing"
    references = {"": base_model(real_model_dir), "a": merged_model(real_model_dir, adapter)}
    for request_id, ids, name in requests:
        ref, logits = hf_greedy_reference(references[name], ids, NEW_TOKENS)
        assert_greedy_parity(tokens[request_id], ref, logits, context=f"{request_id} on SmolLM2")
