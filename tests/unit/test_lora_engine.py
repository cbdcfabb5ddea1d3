"""The engine's adapters: slots given and taken back (LRU, reads back from disk), adapters refused
with the problem named, unloading while requests run, and the prefix cache kept apart per adapter."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from services.worker.engine.adapters import NoAdapterSlotsError, UnknownAdapterError
from services.worker.model.lora_file import AdapterError
from strata.sampling import SamplingParams
from tests.conftest import build_tiny_model
from tests.lora_adapters import (
    NEW_TOKENS,
    lora_engine,
    merged_model,
    prompts,
    run_requests,
    write_adapter,
)
from tests.parity import assert_greedy_parity, hf_greedy_reference

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-adapters")
    return {
        name: write_adapter(tiny_llama_dir, root / name, seed=seed) for name, seed in (("a", 11), ("b", 12))
    }


def _served_as_merged(
    engine_tokens: dict[str, list[int]],
    requests: list[tuple[str, list[int], str]],
    model_dir: Path,
    adapters: dict[str, Path],
) -> None:
    merged = {name: merged_model(model_dir, path) for name, path in adapters.items()}
    for request_id, prompt, adapter in requests:
        ref, logits = hf_greedy_reference(merged[adapter], prompt, NEW_TOKENS)
        assert_greedy_parity(engine_tokens[request_id], ref, logits, context=f"{request_id} via {adapter}")


def test_one_slot_serves_two_adapters_in_turn(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    """With one slot, requests of a, b, a, b take turns in arrival order (a request waits at the head of
    the queue until no running request uses the slot's adapter): four installs, the last b's. b again
    is served from its slot; a again is read back from disk. Every request equals its merged model."""
    engine = lora_engine(tiny_llama_dir, max_loras=1)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    requests = [(f"r{i}", prompt, "ab"[i % 2]) for i, prompt in enumerate(prompts(4))]
    together: list[set[str]] = []
    tokens = run_requests(
        engine, requests, lambda e: together.append({s.adapter for s in e.scheduler.running})
    )
    assert all(len(kinds) <= 1 for kinds in together), "two adapters ran at once in one slot"
    assert engine.lora is not None
    assert engine.lora.table.num_loads == 4
    again = [("b again", prompts(4)[1], "b")]
    tokens.update(run_requests(engine, again))
    assert engine.lora.table.num_loads == 4, "b was installed again though it held the slot"
    again.append(("a again", prompts(4)[0], "a"))
    tokens.update(run_requests(engine, again[1:]))
    assert engine.lora.table.num_loads == 5, "a was not read back into the slot b had taken"
    _served_as_merged(tokens, requests + again, tiny_llama_dir, adapters)


def _broken(directory: Path, base: Path, tmp_path: Path, problem: str) -> Path:
    """An adapter folder with one problem."""
    if problem == "missing files":
        directory.mkdir()
    elif problem == "corrupt weights":
        write_adapter(base, directory, seed=5)
        (directory / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    elif problem == "another base":
        other = build_tiny_model(tmp_path / "other", "llama", hidden_size=32, tie_word_embeddings=True)
        write_adapter(other, directory, seed=5)
    elif problem == "rank above the slots'":
        write_adapter(base, directory, seed=5, rank=32)
    elif problem == "a module outside the layers":
        write_adapter(base, directory, seed=5, modules=("q_proj", "lm_head"))
    elif problem == "DoRA":
        write_adapter(base, directory, seed=5, use_dora=True)
    elif problem == "unreadable config":
        write_adapter(base, directory, seed=5)
        (directory / "adapter_config.json").write_text("{")
    return directory


PROBLEMS = {
    "missing files": "no adapter_config.json",
    "corrupt weights": "not a readable safetensors file",
    "another base": "trained for another base",
    "rank above the slots'": "above this worker's max_lora_rank=16",
    "a module outside the layers": "not a LoRA A or B of a decoder layer",
    "DoRA": "DoRA",
    "unreadable config": "not readable JSON",
}


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_an_unfit_adapter_is_refused_naming_the_problem(
    problem: str, tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The refusal names the adapter and its problem; the engine keeps serving what it served."""
    engine = lora_engine(tiny_llama_dir, max_loras=2)
    engine.load_adapter("a", adapters["a"])
    broken = _broken(tmp_path / "broken", tiny_llama_dir, tmp_path, problem)
    with pytest.raises(AdapterError, match=PROBLEMS[problem]) as refused:
        engine.load_adapter("broken", broken)
    assert "'broken'" in str(refused.value)
    assert engine.adapter_names == ["a"]
    requests = [("after", prompts(1)[0], "a")]
    _served_as_merged(run_requests(engine, requests), requests, tiny_llama_dir, adapters)


def test_an_engine_without_slots_refuses_adapters(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    engine = lora_engine(tiny_llama_dir)
    with pytest.raises(NoAdapterSlotsError, match=r"engine\.lora\.max_loras is 0"):
        engine.load_adapter("a", adapters["a"])
    with pytest.raises(UnknownAdapterError, match="'a' is not loaded"):
        engine.validate([5, 6], SamplingParams(max_new_tokens=2), "a")


def test_unloading_lets_running_requests_finish_and_refuses_new_ones(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """A request running through an adapter when it is unloaded ends as its merged model would; a new
    one is refused naming it; once nothing uses it, its slot is free and the name may be loaded again."""
    engine = lora_engine(tiny_llama_dir, max_loras=1)
    engine.load_adapter("a", adapters["a"])
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = prompts(1)[0]
    engine.add_request("running", prompt, params, adapter="a")
    tokens = list(engine.step()[0].new_token_ids)
    engine.unload_adapter("a")
    with pytest.raises(UnknownAdapterError, match="'a' is not loaded"):
        engine.validate(prompt, params, "a")
    assert engine.adapter_names == []
    while engine.has_work():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    _served_as_merged({"running": tokens}, [("running", prompt, "a")], tiny_llama_dir, adapters)
    # The name is free again (here for b's weights), and the one slot too: its request runs.
    engine.load_adapter("a", adapters["b"])
    requests = [("reloaded", prompt, "a")]
    _served_as_merged(run_requests(engine, requests), requests, tiny_llama_dir, {"a": adapters["b"]})


def _cached(engine: LLMEngine, prompt: list[int], adapter: str) -> int:
    """Prompt tokens the prefix cache served to one request of `adapter` ("" the base)."""
    params = SamplingParams(max_new_tokens=1)
    seq = engine.add_request(f"c{engine.stats().num_steps}", prompt, params, adapter=adapter)
    while engine.has_work():
        engine.step()
    return seq.num_cached_tokens


def test_the_prefix_cache_is_kept_apart_per_adapter_and_load(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """A block computed through one adapter serves that adapter only, and not a later load of its name:
    its keys and values are the adapter's."""
    engine = lora_engine(tiny_llama_dir, max_loras=2)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    prompt = list(range(10, 40))
    assert _cached(engine, prompt, "") == 0
    assert _cached(engine, prompt, "a") == 0
    assert _cached(engine, prompt, "b") == 0
    assert _cached(engine, prompt, "a") > 0
    assert _cached(engine, prompt, "") > 0
    engine.unload_adapter("a")
    engine.load_adapter("a", adapters["a"])
    assert _cached(engine, prompt, "a") == 0


def test_adapter_settings_are_checked(tiny_llama_dir: Path) -> None:
    from pydantic import ValidationError

    from services.worker.engine.config import LoraConfig

    with pytest.raises(ValidationError, match="lora__max_loras=-1 is invalid"):
        LoraConfig(max_loras=-1)
    with pytest.raises(ValidationError, match="lora__max_lora_rank=0 is invalid"):
        LoraConfig(max_lora_rank=0)
    engine = lora_engine(tiny_llama_dir, max_loras=1)
    with pytest.raises(AdapterError, match="hold no ':'"):
        engine.load_adapter("base:x", tiny_llama_dir)
    assert json.dumps(engine.adapter_names) == "[]"


def test_an_evicted_adapter_whose_files_changed_is_unloaded_not_read_back(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Read back after an eviction, an adapter must find the files it was loaded from: changed, it is
    unloaded and the request waiting for it ends with an error; the engine goes on serving."""
    import shutil

    from services.worker.engine.sequence import FinishReason

    copied = shutil.copytree(adapters["a"], tmp_path / "a")
    engine = lora_engine(tiny_llama_dir, max_loras=1)
    engine.load_adapter("a", copied)
    engine.load_adapter("b", adapters["b"])
    run_requests(engine, [("first a", prompts(1)[0], "a"), ("then b", prompts(1)[0], "b")])
    weights = copied / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")
    params = SamplingParams(max_new_tokens=4)
    engine.add_request("a again", prompts(1)[0], params, adapter="a")
    ended = []
    while engine.has_work():
        ended += [out for out in engine.step() if out.request_id == "a again"]
    assert [(out.finish_reason, out.new_token_ids) for out in ended] == [(FinishReason.ERROR, [])]
    assert engine.adapter_names == ["b"]
    requests = [("b still", prompts(1)[0], "b")]
    _served_as_merged(run_requests(engine, requests), requests, tiny_llama_dir, adapters)
