"""The native decode stack (one call for every layer of a small decode-only step) against the
per-operator path it replaces: the same bits, on float32 and int8 weights, GQA, MQA and biased
projections, over a float32 or an int8 KV cache; and the steps it must leave to that path (prefills,
mixed steps, more than MAX_ROWS).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from services.worker.model import decode_stack, kv_format, native
from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import load_model
from services.worker.model.small_linear import MAX_ROWS
from tests.native_calls import count_decode_stack_calls

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.model.loader import LoadedModel

BLOCK = 16


@pytest.fixture(autouse=True)
def _native_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_enabled", True)


def _prefilled(
    loaded: LoadedModel, lengths: list[int], cache_dtype: str = "float32"
) -> tuple[KVCache, list[list[int]]]:
    """A cache holding one prompt of each length, prefilled through the per-operator path."""
    blocks_each = -(-(max(lengths) + 4) // BLOCK)
    fmt = kv_format.resolve(cache_dtype, torch.float32, "cpu")
    cache = KVCache.allocate(loaded.config, blocks_each * len(lengths), BLOCK, fmt, "cpu")
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(lengths))]
    gen = torch.Generator().manual_seed(sum(lengths))
    with torch.inference_mode():
        for length, table in zip(lengths, tables, strict=True):
            ids = torch.randint(0, loaded.config.vocab_size, (length,), generator=gen)
            meta = AttentionMetadata.build([length], [length], [table], BLOCK, "cpu", 0)
            loaded.model(ids, torch.arange(length), meta, cache)
    return cache, tables


def _decode(loaded: LoadedModel, cache: KVCache, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
    """One decode step of every sequence (its next position), returning the final hidden states."""
    rows = len(lengths)
    ids = torch.arange(rows) * 7 + 3
    meta = AttentionMetadata.build([1] * rows, [n + 1 for n in lengths], tables, BLOCK, "cpu", rows)
    with torch.inference_mode():
        hidden: torch.Tensor = loaded.model(ids, torch.tensor(lengths), meta, cache)
    return hidden


def _copy(cache: KVCache) -> KVCache:
    return KVCache(tuple(k.clone() for k in cache.keys), tuple(v.clone() for v in cache.values), cache.format)


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
@pytest.mark.parametrize("quantization", [None, "dynamic-int8"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_linear_mqa_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("lengths", [[5], [17, 3, 40], [9] * MAX_ROWS])
def test_the_stack_gives_the_per_operator_paths_bits(
    fixture: str,
    quantization: str | None,
    lengths: list[int],
    cache_dtype: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same hidden states and the same k/v written into the cache, to the bit, as the layer-by-layer
    path; the stack must have run (a counted call), and the reference must not have."""
    model_dir: Path = request.getfixturevalue(fixture)
    loaded = load_model(model_dir, quantization=quantization)
    cache, tables = _prefilled(loaded, lengths, cache_dtype)
    reference_cache = _copy(cache)
    calls = count_decode_stack_calls(monkeypatch)
    fused = _decode(loaded, cache, tables, lengths)
    assert calls == [1]
    monkeypatch.setattr(decode_stack, "applies", lambda *_: False)
    reference = _decode(loaded, reference_cache, tables, lengths)
    assert calls == [1]
    assert torch.equal(fused, reference)
    for ours, theirs in zip(
        (*cache.keys, *cache.values), (*reference_cache.keys, *reference_cache.values), strict=True
    ):
        assert torch.equal(ours, theirs)


def test_prefills_mixed_steps_and_large_batches_take_the_per_operator_path(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = load_model(tiny_llama_dir)
    calls = count_decode_stack_calls(monkeypatch)
    cache, tables = _prefilled(loaded, [6] * (MAX_ROWS + 1))
    assert calls == []  # prefills
    _decode(loaded, cache, tables, [6] * (MAX_ROWS + 1))
    assert calls == []  # more than MAX_ROWS decodes
    mixed = AttentionMetadata.build([1, 4], [7, 4], tables[:2], BLOCK, "cpu", 1)
    with torch.inference_mode():
        loaded.model(torch.arange(5), torch.tensor([6, 0, 1, 2, 3]), mixed, cache)
    assert calls == []  # a decode mixed with a prefill chunk
    _decode(loaded, cache, tables[:2], [7, 7])
    assert calls == [1]


def test_the_stack_is_rebuilt_for_a_new_cache(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second cache (the memory profile's scratch, then the real one) gets views of its own blocks:
    the step's k/v land in it, not in the first cache."""
    loaded = load_model(tiny_llama_dir)
    first, tables = _prefilled(loaded, [8])
    _decode(loaded, first, tables, [8])
    second, _ = _prefilled(loaded, [8])
    expected = _copy(second)
    with monkeypatch.context() as patched:
        patched.setattr(decode_stack, "applies", lambda *_: False)
        reference = _decode(loaded, expected, tables, [8])
    got = _decode(loaded, second, tables, [8])
    assert torch.equal(got, reference)
    assert torch.equal(second.keys[0], expected.keys[0])


def test_set_enabled_turns_the_stack_off(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(tiny_llama_dir)
    cache, tables = _prefilled(loaded, [4])
    calls = count_decode_stack_calls(monkeypatch)
    previous = decode_stack.set_enabled(False)
    try:
        _decode(loaded, cache, tables, [4])
    finally:
        decode_stack.set_enabled(previous)
    assert calls == []
    _decode(loaded, cache, tables, [5])
    assert calls == [1]


def test_without_the_kernels_the_per_operator_path_runs(tiny_llama_dir: Path) -> None:
    loaded = load_model(tiny_llama_dir)
    cache, tables = _prefilled(loaded, [4])
    previous = native.set_enabled(False)
    try:
        hidden = _decode(loaded, cache, tables, [4])
    finally:
        native.set_enabled(previous)
    assert hidden.shape == (1, loaded.config.hidden_size)
