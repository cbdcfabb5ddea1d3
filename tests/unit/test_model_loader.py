"""The loader and config parser: what loads (sharded, bf16, legacy configs) and what is refused, and why."""

from __future__ import annotations

import json
import shutil
import sys
from typing import TYPE_CHECKING, Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from services.worker.model.attention import AttentionMetadata
from services.worker.model.config import ModelLoadError
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import load_model
from services.worker.model.registry import config_from_dict, load_config

if TYPE_CHECKING:
    from pathlib import Path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def _prefill_logits(directory: Path, **kwargs: Any) -> torch.Tensor:
    loaded = load_model(directory, **kwargs)
    cache = KVCache.allocate(loaded.config, 4, 8, loaded.dtype, "cpu")
    meta = AttentionMetadata.build([6], [6], [[2]], 8, "cpu", 0)
    ids = torch.tensor([5, 9, 1, 200, 17, 3])
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(ids, torch.arange(6), meta, cache))


def test_loads_float32_on_cpu_by_default(tiny_llama_dir: Path) -> None:
    loaded = load_model(tiny_llama_dir)
    assert loaded.dtype == torch.float32
    assert loaded.device == torch.device("cpu")
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.config.tie_word_embeddings
    assert loaded.model.lm_head is None
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in loaded.model.parameters())


# bfloat16 keeps 8 significant bits: a value's rounding error is up to 2**-8 of it. Two correct bf16
# programs that order their sums differently disagree by a few such roundings of the largest
# activations on the way; BF16_ULPS of them, scaled by the reference's largest |logit|, is the bound.
BF16_EPS = 2.0**-8
BF16_ULPS = 4


def bf16_tolerance(reference: torch.Tensor) -> float:
    return BF16_ULPS * BF16_EPS * max(1.0, float(reference.abs().max()))


def test_bfloat16_on_request(tiny_llama_dir: Path) -> None:
    loaded = load_model(tiny_llama_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    logits = _prefill_logits(tiny_llama_dir, dtype=torch.bfloat16)
    assert logits.dtype == torch.float32
    # The reference: transformers in bfloat16 on the same weights, the same six tokens.
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    with torch.inference_mode():
        reference = hf(torch.tensor([[5, 9, 1, 200, 17, 3]])).logits[0].float()
    tolerance = bf16_tolerance(reference)
    difference = float((logits - reference).abs().max())
    assert difference <= tolerance, (
        f"bf16 logits differ from transformers' by {difference:.4g} > {tolerance:.4g}"
    )
    # The bound is tight enough to catch a broken path: one layer's output projection zeroed fails it.
    broken = load_model(tiny_llama_dir, dtype=torch.bfloat16)
    first: Any = broken.model.layers[0]
    first.self_attn.o_proj.weight.zero_()
    cache = KVCache.allocate(broken.config, 4, 8, broken.dtype, "cpu")
    meta = AttentionMetadata.build([6], [6], [[2]], 8, "cpu", 0)
    with torch.inference_mode():
        wrong = broken.model.compute_logits(
            broken.model(torch.tensor([5, 9, 1, 200, 17, 3]), torch.arange(6), meta, cache)
        )
    assert float((wrong - reference).abs().max()) > tolerance


def test_sharded_checkpoint_loads_like_a_single_file(tiny_llama_untied_dir: Path, tmp_path: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_untied_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert torch.equal(_prefill_logits(sharded), _prefill_logits(tiny_llama_untied_dir))
    shard = sorted(sharded.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"{shard.name}.*missing"):
        load_model(sharded)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(tmp_path / "absent")


def test_missing_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = _copy(tiny_llama_dir, tmp_path / "m")
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="has no weights"):
        load_model(directory)


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "Gemma3ForConditionalGeneration"])
def test_unsupported_architecture_is_named(tiny_llama_dir: Path, tmp_path: Path, arch: str) -> None:
    directory = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(directory, architectures=[arch])
    with pytest.raises(ModelLoadError) as info:
        load_model(directory)
    assert arch in str(info.value)
    assert "LlamaForCausalLM" in str(info.value)
    assert "Qwen2ForCausalLM" in str(info.value)


def test_pickle_only_checkpoint_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = _copy(tiny_llama_dir, tmp_path / "m")
    weights = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    torch.save(weights, directory / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*safetensors are required"):
        load_model(directory)


def test_missing_tensor_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = _copy(tiny_llama_dir, tmp_path / "m")
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, directory / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(directory)


def test_shape_mismatch_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(directory, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"gate_up_proj\.weight has shape \(256, 64\).*\(192, 64\)"):
        load_model(directory)


def test_unexpected_tensor_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = _copy(tiny_llama_dir, tmp_path / "m")
    weights = load_file(directory / "model.safetensors")
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(weights, directory / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"unexpected tensor.*q_norm"):
        load_model(directory)


def test_quantization_without_bitsandbytes(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import bitsandbytes` raise ImportError even where it is installed.
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    for mode in ("int8", "nf4"):
        with pytest.raises(ModelLoadError, match=rf"quantization='{mode}' needs the bitsandbytes package"):
            load_model(tiny_llama_dir, quantization=mode)


def test_unknown_quantization_mode(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"quantization='int4' is not supported.*int8, nf4"):
        load_model(tiny_llama_dir, quantization="int4")


def test_prequantized_checkpoint_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(directory, quantization_config={"quant_method": "fp8"})
    with pytest.raises(ModelLoadError, match="quant_method='fp8'"):
        load_model(directory)
    # A GPTQ config over float weights is a mislabelled folder, not a float model.
    _edit_config(directory, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ModelLoadError, match="no qweight tensors"):
        load_model(directory)


BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}


def test_legacy_rope_fields() -> None:
    config = config_from_dict(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert (config.rope.rope_type, config.rope.theta, config.rope.factor) == ("linear", 500000.0, 2.0)
    assert config_from_dict({**BASE, "rope_theta": 123.0}).rope.theta == 123.0
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3["original_max_position_embeddings"] = 64
    config = config_from_dict({**BASE, "rope_scaling": llama3})
    assert (config.rope.rope_type, config.rope.original_max_position_embeddings) == ("llama3", 64)
    assert config.rope.theta == 10000.0


def test_transformers5_rope_parameters() -> None:
    config = config_from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    assert (config.rope.rope_type, config.rope.theta) == ("default", 7.0)


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope"])
def test_unsupported_rope_scaling_is_named(kind: str) -> None:
    with pytest.raises(ModelLoadError, match=f"RoPE scaling type '{kind}' is not supported.*llama3"):
        config_from_dict({**BASE, "rope_scaling": {"rope_type": kind, "factor": 2.0}})


def test_config_fields_and_generation_eos(tiny_llama_dir: Path, tmp_path: Path) -> None:
    config = config_from_dict({**BASE, "eos_token_id": [5, 6], "attention_bias": True})
    assert config.eos_token_ids == (5, 6)
    assert (config.head_dim, config.q_size, config.kv_size) == (16, 64, 32)
    assert config.attention_bias and config.o_proj_bias
    qwen = config_from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen.attention_bias and not qwen.o_proj_bias
    windowed = {
        **BASE,
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": True,
        "sliding_window": 8,
    }
    assert config_from_dict({**windowed, "max_window_layers": 1}).layer_windows == (None, 8)
    with pytest.raises(ModelLoadError, match="num_key_value_heads=3"):
        config_from_dict({**BASE, "num_key_value_heads": 3})
    directory = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(directory, eos_token_id=2)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_config(directory)[1].eos_token_ids == (2, 7)
