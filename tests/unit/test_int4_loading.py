"""AWQ and GPTQ int4 checkpoints, packed in the test as their packers pack them, loaded as ggml blocks.

Each projection's blocks must stand for exactly the values the checkpoint packs, (q - zero) * scale
(a Q4_1 block's float16 offset is the one rounding: under a thousandth of a quantization step per
zero); the kernels' products equal dequantize-then-matmul; a whole tiny model loaded from its AWQ
or GPTQ folder (act-order included) gives the greedy tokens and logits of the same model with every
projection replaced by its dequantized weight; and every configuration the loader does not read is
refused with the value and the fix.
"""

from __future__ import annotations

import json
import shutil
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
from gguf import GGMLQuantizationType

from services.worker.engine.memory_profile import weights_bytes
from services.worker.model import native
from services.worker.model.config import ModelLoadError
from services.worker.model.gguf_linear import GgufLinear
from services.worker.model.int4_checkpoint import Int4Scheme, int4_scheme, int4_weight
from services.worker.model.loader import load_model
from tests.conftest import build_tiny_model
from tests.int4_files import Int4Layout, quantization_config, quantize, write_int4
from tests.native_calls import count_decode_stack_calls
from tests.parity import assert_logits_close, paged_greedy_generate, prefill_logits

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.model.layers import DecoderLayer

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")

SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = [[1, 17, 29, 301, 5], [1, 250, 4], [1, 9, 9, 9, 9, 9, 9, 120]]
LAYOUTS = {
    "awq-g128": Int4Layout("awq", 128),
    "awq-g32": Int4Layout("awq", 32),
    "gptq-g64-symmetric": Int4Layout("gptq", 64, symmetric=True),
    "gptq-g32-act-order": Int4Layout("gptq", 32, act_order=True),
    "gptq-v2-g128-act-order": Int4Layout("gptq", 128, act_order=True, checkpoint_format="gptq_v2"),
    "gptq-per-row": Int4Layout("gptq", -1),
}


def _scheme(layout: Int4Layout) -> Int4Scheme:
    scheme = int4_scheme({"quantization_config": quantization_config(layout)})
    assert scheme is not None
    return scheme


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_blocks_stand_for_the_packed_values(name: str) -> None:
    layout = LAYOUTS[name]
    torch.manual_seed(1)
    weight = torch.randn(96, 256)
    order = torch.randperm(256) if layout.act_order else None
    quantized = quantize(weight, layout, order)
    blocks = int4_weight(_scheme(layout), quantized.tensors, "w")
    assert blocks.shape == (96, 256)
    expected_type = GGMLQuantizationType.Q4_0 if layout.symmetric else GGMLQuantizationType.Q4_1
    assert blocks.qtypes == (expected_type,)
    assert (blocks.input_order is not None) == layout.act_order
    got = blocks.dequantize()
    if layout.symmetric:
        assert torch.equal(got, quantized.dequantized)
    else:
        # The offset -zero * scale is stored in float16: off by at most 2^-11 of zero * scale.
        scale = quantized.tensors["scales"].float().amax()
        torch.testing.assert_close(got, quantized.dequantized, rtol=0, atol=float(15 * scale * 2**-11))
        assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("rows", [1, 5, 40, 100])
@pytest.mark.parametrize("name", ["awq-g128", "gptq-g32-act-order"])
def test_the_kernels_multiply_as_dequantize_then_matmul(name: str, rows: int) -> None:
    layout = LAYOUTS[name]
    torch.manual_seed(2)
    weight = torch.randn(64, 256)
    quantized = quantize(weight, layout, torch.randperm(256) if layout.act_order else None)
    linear = GgufLinear(int4_weight(_scheme(layout), quantized.tensors, "w"), torch.randn(64))
    x = torch.randn(rows, 256)
    expected = x @ linear.stored_weight().dequantize().T + cast("torch.Tensor", linear.bias)
    got = linear(x)
    # Up to 8 rows x is rounded to 8 bits per 32 values, as llama.cpp does: ~0.5% of a row's scale.
    tolerance = 2e-2 if rows <= 8 else 1e-4
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance * float(expected.abs().max()))
    # And the blocks' weight is the checkpoint's, so the product is the reference's.
    reference = x @ quantized.dequantized.T + cast("torch.Tensor", linear.bias)
    torch.testing.assert_close(got, reference, rtol=0, atol=2e-2 * float(reference.abs().max()))


def _folders(
    tmp_path_factory: pytest.TempPathFactory, kind: str, layout: Int4Layout, **overrides: Any
) -> tuple[Path, Path]:
    checkpoint = build_tiny_model(
        tmp_path_factory.mktemp(f"{kind}-hf"), kind, seed=3, **{**SHAPE, **overrides}
    )
    int4, reference = tmp_path_factory.mktemp(f"{kind}-int4"), tmp_path_factory.mktemp(f"{kind}-reference")
    write_int4(checkpoint, int4, reference, layout)
    return int4, reference


def _assert_matches_reference(int4: Path, reference: Path) -> None:
    ours, theirs = load_model(int4), load_model(reference)
    for prompt in PROMPTS:
        ours_logits: list[torch.Tensor] = []
        theirs_logits: list[torch.Tensor] = []
        tokens = paged_greedy_generate(ours.model, [prompt], max_new_tokens=8, step_logits=ours_logits)
        expected = paged_greedy_generate(theirs.model, [prompt], max_new_tokens=8, step_logits=theirs_logits)
        assert tokens == expected, prompt
        for a, b in zip(ours_logits, theirs_logits, strict=True):
            assert_logits_close(a, b, atol=1e-3 * max(float(b.abs().max()), 1.0), context=str(prompt))
    batched = prefill_logits(ours.model, PROMPTS)
    torch.testing.assert_close(batched, prefill_logits(theirs.model, PROMPTS), rtol=1e-4, atol=1e-3)


@pytest.mark.usefixtures("gguf_float32_products")
def test_an_awq_llama_matches_its_dequantized_reference_through_the_decode_stack(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    int4, reference = _folders(tmp_path_factory, "llama", LAYOUTS["awq-g32"], tie_word_embeddings=False)
    loaded = load_model(int4)
    assert loaded.weights_format == "AWQ int4 (groups of 32) as stored: Q4_1 x12"
    layer = cast("DecoderLayer", loaded.model.layers[0])
    assert isinstance(layer.self_attn.qkv_proj, GgufLinear) and isinstance(layer.mlp.down_proj, GgufLinear)
    assert type(loaded.model.lm_head) is torch.nn.Linear  # AWQ leaves the vocabulary projection in float
    # The memory budget counts the blocks' bytes: 20 per 32 weights where float32 takes 128.
    projections = sum(
        m.in_features * m.out_features for m in loaded.model.modules() if isinstance(m, GgufLinear)
    )
    saved = weights_bytes(load_model(reference).model) - weights_bytes(loaded.model)
    assert saved == projections * (4 - 20 / 32)
    _assert_matches_reference(int4, reference)
    calls = count_decode_stack_calls(monkeypatch)
    paged_greedy_generate(loaded.model, PROMPTS, max_new_tokens=4)
    assert len(calls) == 3  # every decode step ran the native stack on the int4 blocks


@pytest.mark.usefixtures("gguf_float32_products")
def test_a_gptq_act_order_qwen2_with_biases_matches_its_dequantized_reference(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    int4, reference = _folders(
        tmp_path_factory, "qwen2", LAYOUTS["gptq-g32-act-order"], tie_word_embeddings=True
    )
    loaded = load_model(int4)
    assert loaded.weights_format == "GPTQ int4 (groups of 32) as stored: Q4_1 x12"
    layer = cast("DecoderLayer", loaded.model.layers[0])
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, GgufLinear) and qkv.input_order is not None and qkv.bias is not None
    _assert_matches_reference(int4, reference)
    calls = count_decode_stack_calls(monkeypatch)
    paged_greedy_generate(loaded.model, PROMPTS, max_new_tokens=4)
    # The native stack hands each projection x in the layer's order, so act-order runs layer by layer.
    assert not calls


def test_int4_configurations_not_read_are_refused_with_the_fix(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    int4, _ = _folders(tmp_path_factory, "llama", LAYOUTS["awq-g128"])
    with pytest.raises(ModelLoadError, match="served in the int4 it stores"):
        load_model(int4, quantization="dynamic-int8")
    for change, message in (
        ({"bits": 8}, "only 4-bit"),
        ({"group_size": 16}, "multiple of 32"),
        ({"version": "gemv"}, "GEMM layout"),
        ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        ({"quant_method": "fp8"}, "not supported"),
    ):
        folder = tmp_path / f"bad-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(int4, folder)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"].update(change)
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelLoadError, match=message):
            load_model(folder)
    quantized = quantize(torch.randn(64, 128), Int4Layout("gptq", 32))
    del quantized.tensors["qzeros"]
    with pytest.raises(ModelLoadError, match="incomplete"):
        int4_weight(_scheme(Int4Layout("gptq", 32)), quantized.tensors, "layers.0.q_proj.weight")
