"""The model's shape and hyper-parameters, read from a Hugging Face config.json.

This module owns translating a checkpoint's config (either transformers layout: `rope_theta` plus
`rope_scaling`, or the 5.x `rope_parameters`) into one frozen `ModelConfig`, and refusing at once what
our implementation cannot run, with a message that names the value and the supported ones. It must not
import torch or read weights: the engine sizes its KV cache from a config alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DEFAULT_ROPE_THETA = 10000.0


class ModelLoadError(Exception):
    """A model directory cannot be loaded. The message names what is wrong and how to fix it."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters. `factor` and the llama3 fields are unused by the default type."""

    rope_type: str = "default"
    theta: float = _DEFAULT_ROPE_THETA
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the forward pass and the KV cache need to know about a Llama-family model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Llama puts `attention_bias` on o_proj too; Qwen2 has q/k/v biases only.
    o_proj_bias: bool = False

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json; raise ModelLoadError for anything unsupported."""
        arch = _architecture(raw)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act={act!r} is not supported: Llama-family models use 'silu'")
        if arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window", False):
            raise ModelLoadError(
                "use_sliding_window=true is not supported: set it to false in config.json "
                "(Qwen2 checkpoints are trained with full attention)"
            )
        heads = _int(raw, "num_attention_heads")
        hidden = _int(raw, "hidden_size")
        head_dim = raw.get("head_dim") or hidden // heads
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        quant = raw.get("quantization_config") or {}
        # A GGUF export's safetensors are already dequantized floats; any other method stores packed ints.
        if isinstance(quant, dict) and quant and quant.get("quant_method") != "gguf":
            raise ModelLoadError(
                f"pre-quantized checkpoints (quant_method={quant.get('quant_method')!r}) are not supported: "
                "load a float checkpoint and pass quantization='int8' or 'nf4' instead"
            )
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = True if is_qwen2 else bool(raw.get("attention_bias", False))
        max_pos = _int(raw, "max_position_embeddings")
        return cls(
            architecture=arch,
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size"),
            num_hidden_layers=_int(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope(raw, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=False if is_qwen2 else bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            o_proj_bias=attention_bias and not is_qwen2,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read one config.json file."""
        return cls.from_dict(_read_json(Path(path)))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read config.json from a model directory, adding generation_config.json's EOS ids if present.

        Instruct checkpoints often list their end-of-turn token only in generation_config.json.
        """
        directory = Path(model_dir)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(
                f"{directory} has no config.json: point at a Hugging Face model directory "
                "(config.json plus *.safetensors)"
            )
        config = cls.from_json(config_path)
        generation_path = directory / "generation_config.json"
        if not generation_path.is_file():
            return config
        extra = _token_ids(_read_json(generation_path).get("eos_token_id"))
        merged = config.eos_token_ids + tuple(t for t in extra if t not in config.eos_token_ids)
        return replace(config, eos_token_ids=merged)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        model_type = raw.get("model_type")
        by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        if model_type in by_type:
            return by_type[model_type]
        archs = [f"<none; model_type={model_type!r}>"]
    arch = str(archs[0])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {arch} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"config.json: {key}={value!r} must be a positive integer")
    return value


def _token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    raise ModelLoadError(f"config.json: eos_token_id={value!r} must be an integer or a list of integers")


def _rope(raw: dict[str, Any], max_pos: int) -> RopeConfig:
    # transformers 5.x writes `rope_parameters` (theta inside); 4.x wrote `rope_theta` + `rope_scaling`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"config.json: rope_parameters={params!r} must be an object")
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    theta = float(params.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"RoPE scaling type {rope_type!r} is not supported; supported types: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("partial_rotary_factor != 1 is not supported by Llama-family models")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise ModelLoadError(f"RoPE type {rope_type!r} needs a 'factor' in rope_parameters/rope_scaling")
    factor = float(params["factor"])
    if rope_type == "linear":
        return RopeConfig(rope_type="linear", theta=theta, factor=factor)
    return RopeConfig(
        rope_type="llama3",
        theta=theta,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", max_pos)),
    )
