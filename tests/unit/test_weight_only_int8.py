"""quantization="int8-weight-only": weight-only int8 projections at every batch size, whose rows do not
depend on their batch.

The mode must replace every decoder projection and the vocabulary projection by its int8 copy (one
scale per row) and keep no float32 weight of theirs. A request's logits must be the same bits alone
and inside a batch of 24 with other requests: decode rows (alone they take the native decode stack,
in the batch the per-operator path with the projections chunked through the kernel) and prefill
chunks (alone, or beside other prompts' chunks and decodes in one step); torch's dynamic int8 fails
the same check, so the check can fail. Both on tiny random models and, marked real_model, on
SmolLM2-135M. The engine's greedy outputs follow: alone and batched they are the same tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
from torch import nn

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model import native
from services.worker.model.attention import AttentionMetadata
from services.worker.model.config import ModelLoadError
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import load_model
from services.worker.model.small_int8 import SmallBatchInt8, WeightOnlyInt8
from services.worker.model.small_linear import MAX_ROWS
from services.worker.settings import WorkerSettings
from strata.sampling import SamplingParams
from tests.native_calls import count_decode_stack_calls

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.model.loader import LoadedModel

MODE = "int8-weight-only"
BLOCK = 16
BATCH = 24
TINY = ["tiny_llama_dir", "tiny_llama_untied_dir", "tiny_qwen2_dir"]


@pytest.fixture(autouse=True)
def _native_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_enabled", True)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


class Steps:
    """Sequences on one KV cache, each with blocks of its own, stepped alone or together."""

    def __init__(self, loaded: LoadedModel, prompts: list[list[int]]) -> None:
        self.loaded = loaded
        self.prompts = prompts
        self.blocks_each = -(-(max(len(p) for p in prompts) + 2) // BLOCK)
        blocks = self.blocks_each * len(prompts)
        self.cache = KVCache.allocate(loaded.config, blocks, BLOCK, torch.float32, "cpu")

    def table(self, index: int) -> list[int]:
        return list(range(index * self.blocks_each, (index + 1) * self.blocks_each))

    def step(self, decodes: list[int], prefills: list[int]) -> list[torch.Tensor]:
        """One step: a next token of each sequence in `decodes` (its prompt already in the cache), then
        the whole prompt of each in `prefills`; every token's logits, one tensor per sequence."""
        ids: list[int] = []
        positions: list[int] = []
        for s in decodes:
            ids.append((7 * s + 5) % self.loaded.config.vocab_size)
            positions.append(len(self.prompts[s]))
        for s in prefills:
            ids += self.prompts[s]
            positions += range(len(self.prompts[s]))
        query_lens = [1] * len(decodes) + [len(self.prompts[s]) for s in prefills]
        context_lens = [len(self.prompts[s]) + 1 for s in decodes] + [len(self.prompts[s]) for s in prefills]
        tables = [self.table(s) for s in (*decodes, *prefills)]
        meta = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK, "cpu", len(decodes))
        with torch.inference_mode():
            hidden = self.loaded.model(torch.tensor(ids), torch.tensor(positions), meta, self.cache)
            logits = self.loaded.model.compute_logits(hidden)
        return list(logits.split(query_lens))


def _alone_and_batched(
    loaded: LoadedModel, lengths: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sequence's decode logits stepped alone, and all of them in one step; prompts prefilled alone.

    One cache serves both: a step writes its tokens' k/v before it reads them."""
    prompts = _prompts(loaded.config.vocab_size, lengths, seed=len(lengths))
    steps = Steps(loaded, prompts)
    for s in range(len(prompts)):
        steps.step([], [s])
    singles = [steps.step([s], [])[0] for s in range(len(prompts))]
    return singles, steps.step(list(range(len(prompts))), [])


@pytest.mark.parametrize("fixture", TINY)
def test_every_projection_is_weight_only_int8_and_no_float32_copy_is_kept(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    loaded = load_model(request.getfixturevalue(fixture), quantization=MODE)
    assert loaded.quantization == MODE
    projections = [m for m in loaded.model.modules() if isinstance(m, WeightOnlyInt8)]
    # Four per layer (q/k/v, o, gate/up, down) and the vocabulary projection.
    assert len(projections) == 4 * loaded.config.num_hidden_layers + 1
    assert not any(isinstance(m, SmallBatchInt8) for m in projections)
    assert not any(isinstance(m, nn.Linear) for m in loaded.model.modules())
    assert all(p.weight_int8.dtype == torch.int8 and p.scale.dtype == torch.float32 for p in projections)
    assert loaded.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("fixture", TINY)
def test_decode_rows_are_the_same_bits_alone_and_in_a_batch_of_24(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alone, each row runs the native decode stack; in the batch, the per-operator path, each
    projection chunked MAX_ROWS rows to a kernel call: both give every row the same logits."""
    loaded = load_model(request.getfixturevalue(fixture), quantization=MODE)
    calls = count_decode_stack_calls(monkeypatch)
    singles, batched = _alone_and_batched(loaded, [3 + (5 * i) % 41 for i in range(BATCH)])
    assert len(calls) == BATCH  # each single step, not the batch of BATCH > MAX_ROWS
    assert BATCH > 2 * MAX_ROWS
    for single, row in zip(singles, batched, strict=True):
        assert torch.equal(single, row)


def test_torch_dynamic_int8_fails_the_same_check(tiny_llama_dir: Path) -> None:
    """What the mode is for: the dynamic path's activation scale is taken over the whole batch."""
    loaded = load_model(tiny_llama_dir, quantization="dynamic-int8")
    singles, batched = _alone_and_batched(loaded, [3 + (5 * i) % 41 for i in range(BATCH)])
    assert sum(not torch.equal(single, row) for single, row in zip(singles, batched, strict=True)) > 0


@pytest.mark.parametrize("fixture", TINY)
def test_prefill_chunks_are_the_same_bits_alone_and_beside_other_rows(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """A prompt prefilled alone, and in one step with 20 decodes and two other prompts (29 + rows)."""
    loaded = load_model(request.getfixturevalue(fixture), quantization=MODE)
    prompts = _prompts(loaded.config.vocab_size, [9] * 20 + [13, 5, 11], seed=7)
    _assert_prefills_unchanged_beside(Steps(loaded, prompts), decodes=20)


def _assert_prefills_unchanged_beside(steps: Steps, decodes: int) -> None:
    """The prompts after the first `decodes` give the same logits prefilled alone and in one step with
    the others (those first prefilled, then decoding)."""
    others = range(decodes, len(steps.prompts))
    alone = [steps.step([], [s])[0] for s in others]
    for s in range(decodes):
        steps.step([], [s])
    mixed = steps.step(list(range(decodes)), list(others))[decodes:]
    for single, logits in zip(alone, mixed, strict=True):
        assert torch.equal(single, logits)


def test_without_the_kernels_it_computes_the_same_product_through_torch(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = load_model(tiny_llama_dir, quantization=MODE)
    projection = next(m for m in loaded.model.modules() if isinstance(m, WeightOnlyInt8))
    x = torch.randn(BATCH, projection.in_features, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        kernel = projection(x)
        monkeypatch.setattr(native, "_enabled", False)
        through_torch = projection(x)
    assert not torch.equal(kernel, through_torch) or BATCH <= MAX_ROWS  # another path was taken
    assert torch.allclose(kernel, through_torch, rtol=1e-4, atol=1e-4)


def test_the_engines_greedy_outputs_are_the_same_alone_and_batched(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=128), quantization=MODE)
    prompts = _prompts(384, [2 + (7 * i) % 30 for i in range(BATCH)], seed=3)
    params = [SamplingParams(max_new_tokens=6 + i % 5, ignore_eos=True) for i in range(BATCH)]
    batched = engine.generate(prompts, params)
    alone = [engine.generate([p], [q])[0] for p, q in zip(prompts, params, strict=True)]
    assert batched == alone


@pytest.mark.real_model
def test_real_models_rows_are_the_same_bits_alone_and_in_a_batch_of_24(real_model_dir: Path) -> None:
    loaded = load_model(real_model_dir, quantization=MODE)
    singles, batched = _alone_and_batched(loaded, [4 + (9 * i) % 60 for i in range(BATCH)])
    for single, row in zip(singles, batched, strict=True):
        assert torch.equal(single, row)
    prompts = _prompts(loaded.config.vocab_size, [5] * 12 + [40, 17], seed=11)
    _assert_prefills_unchanged_beside(Steps(loaded, prompts), decodes=12)


def test_cuda_and_bfloat16_are_refused_with_the_fix_named(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=f"quantization='{MODE}' runs on the CPU only") as info:
        load_model(tiny_llama_dir, device="cuda", quantization=MODE)
    assert "nf4" in str(info.value)
    with pytest.raises(ModelLoadError, match=f"quantization='{MODE}' computes in float32"):
        load_model(tiny_llama_dir, dtype=torch.bfloat16, quantization=MODE)


def test_worker_settings_accept_the_mode_and_name_every_mode_otherwise(tiny_llama_dir: Path) -> None:
    settings = WorkerSettings.build(
        {"model_name": "tiny", "model_path": tiny_llama_dir, "quantization": MODE}
    )
    assert settings.quantization == MODE
    with pytest.raises(ModelLoadError, match=f"dynamic-int8, int8, nf4, {MODE}"):
        load_model(tiny_llama_dir, quantization="weight-only")
