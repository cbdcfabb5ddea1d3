"""quantization="dynamic-int8": torch's dynamic int8 projections on tiny models, on the CPU only.

For batches above small_linear.MAX_ROWS the mode must replace exactly the decoder's q/k/v, o and
gate/up projections (down_proj, embeddings, norms and the vocabulary projection stay float32); at most
MAX_ROWS rows, every projection and the vocabulary projection must read its weight-only int8 copy
through the native kernel. The mode must stay quiet about torch's deprecation of the API it wraps, and
refuse CUDA and non-float32 dtypes with a message that names the fix.

How close to float32 is close enough comes from int8 rounding itself. Each projection is checked on
the activations the quantized model feeds it against its float32 weight, under the worst case of its
rounding: a weight-only copy with one scale s_n = max|W_n| / 127 per output row moves each weight by
at most s_n / 2, so an output moves by at most s_n / 2 * |x|_1; the dynamic path's per-tensor weight
scale and per-call activation scale add their own half steps. A wrong scale or a misplaced row moves
an output by its own size, far past that bound. The whole model's logits must then stay within
RELATIVE_TOLERANCE of float32's and pick float32's top token at TOP1_AGREEMENT of the positions.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model.attention import AttentionMetadata
from services.worker.model.config import ModelLoadError
from services.worker.model.dynamic_int8 import DYNAMIC_INT8_LAYERS
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import LoadedModel, load_model
from services.worker.model.small_int8 import SmallBatchInt8
from services.worker.model.small_linear import MAX_ROWS
from services.worker.settings import WorkerSettings
from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

MODE = "dynamic-int8"
PROMPT = [5, 77, 120, 9, 300, 41, 8, 250, 17, 63, 201, 2]
RELATIVE_TOLERANCE = 0.1
"""Most relative error of the logits: measured 0.004 to 0.028 on these models (a few percent is what
half-step roundings compound to over 3 layers), while a wrong scale or row moves logits by ~1."""
TOP1_AGREEMENT = 0.75
"""Least share of positions whose top token is float32's: measured 1.0; a random model's logits have
near ties (top-two margins of 0.007), so a correct int8 model may flip a few."""


def _logits(loaded: LoadedModel, chunk: int = len(PROMPT)) -> torch.Tensor:
    """The prompt's logits, prefilled `chunk` tokens per step (so every call has at most `chunk` rows)."""
    cache = KVCache.allocate(loaded.config, 8, 16, loaded.dtype, torch.device("cpu"))
    rows = []
    with torch.inference_mode():
        for start in range(0, len(PROMPT), chunk):
            end = min(len(PROMPT), start + chunk)
            meta = AttentionMetadata.build([end - start], [end], [[0]], 16, "cpu", num_decodes=0)
            hidden = loaded.model(torch.tensor(PROMPT[start:end]), torch.arange(start, end), meta, cache)
            rows.append(loaded.model.compute_logits(hidden))
    return torch.cat(rows)


def _projection_inputs(loaded: LoadedModel, chunk: int) -> dict[str, list[torch.Tensor]]:
    """What each int8 projection of `loaded` was given while it prefilled PROMPT `chunk` tokens a step."""
    inputs: dict[str, list[torch.Tensor]] = {}

    def keep(name: str, _module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        inputs.setdefault(name, []).append(args[0].detach().clone())

    handles = [
        module.register_forward_pre_hook(partial(keep, name))
        for name, module in loaded.model.named_modules()
        if isinstance(module, SmallBatchInt8)
    ]
    try:
        _logits(loaded, chunk)
    finally:
        for handle in handles:
            handle.remove()
    return inputs


def _float_projection(full: LoadedModel, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 weight and bias of projection `name` (a tied vocabulary projection: the embeddings)."""
    modules = dict(full.model.named_modules())
    if name == "lm_head" and full.model.lm_head is None:
        embeddings = full.model.embed_tokens
        assert isinstance(embeddings, nn.Embedding)
        return embeddings.weight, None
    linear = modules[name]
    assert isinstance(linear, nn.Linear)
    return linear.weight, linear.bias


def _worst_ratio(error: torch.Tensor, bound: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    """The largest error over its bound; the bound widened by float32's own rounding of a K-term sum
    (relative 1e-4 of sum |x||w|, well above K * 2**-24 for these K). An exact output counts 0,
    even where its bound is 0 too (the all-zero padding row of a tied vocabulary projection)."""
    slack = 1e-4 * (x.abs() @ weight.abs().T)
    ratio = torch.where(error > 0, error / (bound + slack), torch.zeros_like(error))
    return float(ratio.max())


def _model_is_close(full: torch.Tensor, quantized: torch.Tensor) -> tuple[float, float]:
    """(relative error of the logits, share of positions whose top token is float32's)."""
    relative = float((quantized - full).norm() / full.norm())
    agreement = float((quantized.argmax(-1) == full.argmax(-1)).float().mean())
    return relative, agreement


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
        embeddings = model.embed_tokens
        assert isinstance(embeddings, nn.Embedding)
        assert head.large.weight.data_ptr() == embeddings.weight.data_ptr()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_untied_dir"])
def test_each_small_batch_projection_stays_within_its_int8_rounding(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """At most MAX_ROWS rows, every projection (the vocabulary projection too) is its float32 weight's
    product within s_n / 2 * |x|_1 per output, s_n = max|W_n| / 127 taken from the float32 weight."""
    model_dir: Path = request.getfixturevalue(fixture)
    full = load_model(model_dir)
    quantized = load_model(model_dir, quantization=MODE)
    inputs = _projection_inputs(quantized, MAX_ROWS)
    modules = dict(quantized.model.named_modules())
    assert len(inputs) == 4 * quantized.config.num_hidden_layers + 1, sorted(inputs)
    for name, calls in inputs.items():
        weight, bias = _float_projection(full, name)
        step = weight.abs().amax(dim=1) / 127
        for x in calls:
            assert x.shape[0] <= MAX_ROWS
            with torch.inference_mode():
                got = modules[name](x)
            error = (got - F.linear(x, weight, bias)).abs()
            assert error.max() > 0, f"{name}: the int8 copy was not read"
            bound = x.abs().sum(dim=1, keepdim=True) * (step / 2)
            worst = _worst_ratio(error, bound, x, weight)
            assert worst <= 1.0, f"{name}: error {worst:.2f}x its int8 rounding bound"


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_untied_dir"])
def test_each_dynamic_projection_stays_within_its_int8_rounding(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """Above MAX_ROWS rows, each q/k/v, o and gate/up projection runs its dynamic int8 twin. Its weight
    scale s_w = max|W| / 127 (one per tensor) moves a weight by at most s_w / 2; its activations are
    quantized per call over [min(x, 0), max(x, 0)] in at least 127 steps s_x, moving each by at most
    s_x (half a step, and half a step more for the rounded zero point). So an output moves by at most
    s_w / 2 * |x|_1 + s_x * |W_n|_1 + s_w / 2 * s_x * K."""
    model_dir: Path = request.getfixturevalue(fixture)
    full = load_model(model_dir)
    quantized = load_model(model_dir, quantization=MODE)
    inputs = _projection_inputs(quantized, len(PROMPT))
    modules = dict(quantized.model.named_modules())
    dynamic = {
        name: calls for name, calls in inputs.items() if name.rpartition(".")[2] in DYNAMIC_INT8_LAYERS
    }
    assert len(dynamic) == 3 * quantized.config.num_hidden_layers, sorted(dynamic)
    for name, calls in dynamic.items():
        weight, bias = _float_projection(full, name)
        weight_step = float(weight.abs().max()) / 127
        for x in calls:
            assert x.shape[0] > MAX_ROWS
            with torch.inference_mode():
                got = modules[name].large(x)
            error = (got - F.linear(x, weight, bias)).abs()
            input_step = (float(x.max().clamp(min=0)) - float(x.min().clamp(max=0))) / 127
            bound = (
                x.abs().sum(dim=1, keepdim=True) * (weight_step / 2)
                + weight.abs().sum(dim=1) * input_step
                + weight_step / 2 * input_step * x.shape[1]
            )
            worst = _worst_ratio(error, bound, x, weight)
            assert worst <= 1.0, f"{name}: error {worst:.2f}x its int8 rounding bound"


@pytest.mark.parametrize("chunk", [len(PROMPT), MAX_ROWS], ids=["dynamic", "small-batch"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_untied_dir"])
def test_logits_stay_close_to_float32(fixture: str, chunk: int, request: pytest.FixtureRequest) -> None:
    """Each path's logits, compounded over every quantized projection, stay within RELATIVE_TOLERANCE
    of float32's and agree on the top token at most positions; the small batches' path is its own (its
    logits differ from the dynamic path's)."""
    model_dir: Path = request.getfixturevalue(fixture)
    full = _logits(load_model(model_dir), chunk)
    loaded = load_model(model_dir, quantization=MODE)
    quantized = _logits(loaded, chunk)
    assert not torch.equal(full, quantized), "quantization changed nothing"
    if chunk <= MAX_ROWS:
        assert not torch.equal(quantized, _logits(loaded)), "the small batches took the dynamic path"
    relative, agreement = _model_is_close(full, quantized)
    assert relative < RELATIVE_TOLERANCE, f"logits {relative:.3f} off float32's"
    assert agreement >= TOP1_AGREEMENT, f"top token float32's at {agreement:.2f} of the positions"


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
