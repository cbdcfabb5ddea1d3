"""quantization="dynamic-int8": torch's dynamic int8 projections on tiny models, on the CPU only.

For batches above small_linear.MAX_ROWS the mode must replace exactly the decoder's q/k/v, o and
gate/up projections (down_proj, embeddings, norms and the vocabulary projection stay float32); at most
MAX_ROWS rows, every projection and the vocabulary projection must read its weight-only int8 copy
through the native kernel. Both must keep the logits close to float32's; the mode must stay quiet
about torch's deprecation of the API it wraps, and refuse CUDA and non-float32 dtypes with a message
that names the fix.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.params import SamplingParams
from services.worker.model.attention import AttentionMetadata
from services.worker.model.config import ModelLoadError
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import load_model
from services.worker.model.small_int8 import SmallBatchInt8
from services.worker.model.small_linear import MAX_ROWS
from services.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from pathlib import Path

MODE = "dynamic-int8"
PROMPT = [5, 77, 120, 9, 300, 41, 8, 250, 17, 63, 201, 2]


def _logits(model_dir: Path, quantization: str | None, chunk: int = len(PROMPT)) -> torch.Tensor:
    """The prompt's logits, prefilled `chunk` tokens per step (so every call has at most `chunk` rows)."""
    loaded = load_model(model_dir, quantization=quantization)
    cache = KVCache.allocate(loaded.config, 8, 16, loaded.dtype, torch.device("cpu"))
    rows = []
    with torch.inference_mode():
        for start in range(0, len(PROMPT), chunk):
            end = min(len(PROMPT), start + chunk)
            meta = AttentionMetadata.build([end - start], [end], [[0]], 16, "cpu", num_decodes=0)
            hidden = loaded.model(torch.tensor(PROMPT[start:end]), torch.arange(start, end), meta, cache)
            rows.append(loaded.model.compute_logits(hidden))
    return torch.cat(rows)


def _is_int8(module: nn.Module) -> bool:
    weight: Any = getattr(module, "weight", None)
    return not isinstance(module, nn.Linear) and callable(weight) and weight().dtype == torch.qint8


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_untied_dir"])
def test_projections_are_int8_and_the_rest_stays_float32(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    loaded = load_model(model_dir, quantization=MODE)
    assert loaded.quantization == MODE
    assert loaded.dtype == torch.float32
    model = loaded.model
    assert len(model.layers) == loaded.config.num_hidden_layers  # nothing cut
    for layer in model.layers:
        block: Any = layer
        projections = (block.self_attn.qkv_proj, block.self_attn.o_proj, block.mlp.gate_up_proj)
        for projection in (*projections, block.mlp.down_proj):
            assert isinstance(projection, SmallBatchInt8)
            assert projection.weight_int8.dtype == torch.int8
        assert all(_is_int8(projection.large) for projection in projections)
        assert isinstance(block.mlp.down_proj.large, nn.Linear)
        assert block.mlp.down_proj.large.weight.dtype == torch.float32
        assert block.input_layernorm.weight.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == torch.float32
    head = model.lm_head
    assert isinstance(head, SmallBatchInt8)
    assert head.weight_int8.shape == (loaded.config.vocab_size, loaded.config.hidden_size)
    assert isinstance(head.large, nn.Linear)
    assert head.large.weight.dtype == torch.float32
    if loaded.config.tie_word_embeddings:
        # Larger batches project on the embedding matrix itself: no float32 copy was made.
        assert head.large.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_untied_dir"])
def test_logits_stay_close_to_float32(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    full = _logits(model_dir, None)
    quantized = _logits(model_dir, MODE)
    assert not torch.equal(full, quantized), "quantization changed nothing"
    correlation = torch.corrcoef(torch.stack([full.flatten(), quantized.flatten()]))[0, 1]
    assert correlation > 0.9


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_untied_dir"])
def test_small_batches_read_the_int8_copies_and_stay_close_to_float32(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """Chunks of at most MAX_ROWS tokens go through the int8 copies, so their logits differ from both
    float32's and the dynamic path's, and stay close to float32's."""
    model_dir: Path = request.getfixturevalue(fixture)
    full = _logits(model_dir, None, MAX_ROWS)
    small = _logits(model_dir, MODE, MAX_ROWS)
    large = _logits(model_dir, MODE)
    assert not torch.equal(full, small), "the small batches were not quantized"
    assert not torch.equal(small, large), "the small batches took the dynamic path"
    correlation = torch.corrcoef(torch.stack([full.flatten(), small.flatten()]))[0, 1]
    assert correlation > 0.99


def test_no_deprecation_warning_escapes(tiny_llama_dir: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model(tiny_llama_dir, quantization=MODE)
    leaked = [str(w.message)[:80] for w in caught if "quantiz" in str(w.message).lower()]
    assert leaked == []


def test_engine_generates_with_the_quantized_model(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=16), quantization=MODE)
    (output,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert len(output) == 8
    assert all(0 <= token < 384 for token in output)


def test_cuda_is_refused_with_the_gpu_fallback_named(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="CPU only") as info:
        load_model(tiny_llama_dir, device="cuda", quantization=MODE)
    assert "nf4" in str(info.value)


def test_bfloat16_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="float32"):
        load_model(tiny_llama_dir, dtype=torch.bfloat16, quantization=MODE)


def test_unknown_mode_lists_every_mode(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="dynamic-int8, int8, nf4"):
        load_model(tiny_llama_dir, quantization="int4")


def test_worker_settings_accept_the_mode(tiny_llama_dir: Path) -> None:
    settings = WorkerSettings.build(
        {"model_name": "tiny", "model_path": tiny_llama_dir, "quantization": MODE}
    )
    assert settings.quantization == MODE
    assert settings.omp_wait_policy == "PASSIVE"
