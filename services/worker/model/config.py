"""The model's shape and hyper-parameters as one frozen `ModelConfig`, and the helpers that read them.

This module owns the one description of a decoder every family's module fills in from its
checkpoint's config.json (the registry picks the family by `architectures`), and the parsing every
family shares: the Llama-shaped fields (`llama_shape`), RoPE in either transformers layout
(`rope_theta` plus `rope_scaling`, or the 5.x `rope_parameters`), sliding-window layers, and
generation_config.json's extra EOS ids. Refusals are ModelLoadErrors that name the value and the
supported ones. It must not import torch or read weights: the engine sizes its KV cache from a config
alone, and it must not know any one family (each family's module does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
"""config.json's `hidden_act` (or Gemma's `hidden_activation`) -> the MLP's activation."""
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
    """Everything the forward pass and the KV cache need to know about a decoder-only model.

    The fields after `eos_token_ids` are the ways families differ from Llama; their defaults are
    Llama's, so a family's module sets only what it changes.
    """

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
    activation: str = "silu"
    """The MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)."""
    qk_norm: bool = False
    """An RMSNorm over each head of q and of k before RoPE (Qwen3, Gemma 3)."""
    sandwich_norms: bool = False
    """Norms on the attention's and the MLP's outputs too, before each residual add (Gemma 3)."""
    layer_windows: tuple[int | None, ...] = ()
    """Per layer, its sliding window in keys (the query's own included), None for full attention;
    empty when every layer attends to the whole context."""
    sliding_rope: RopeConfig | None = None
    """The RoPE of the sliding-window layers where it differs from `rope` (Gemma 3's local layers)."""
    rotary_dim: int = 0
    """How many leading dims of each head RoPE rotates; 0 means all of `head_dim`."""
    query_scale: float = 0.0
    """The attention's scale of q.k; 0 means head_dim ** -0.5."""
    final_softcap: float | None = None
    """tanh soft-capping of the logits."""
    embedding_scale: float | None = None
    """A factor on the token embeddings (Gemma: sqrt(hidden_size))."""
    tensor_parallel_size: int = 1
    """Ranks the layers are split over; above 1 the head counts and `intermediate_size` here are one
    rank's share (tensor_parallel.shard_config), and the KV cache this config sizes is one rank's."""

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.query_scale or self.head_dim**-0.5

    @property
    def rotated_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to the whole context."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of the model's layers, smallest first."""
        return tuple(sorted({w for w in self.layer_windows if w is not None}))


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or a ModelLoadError that says why it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of a model directory, with generation_config.json's EOS ids merged into its own.

    Instruct checkpoints often list their end-of-turn token only in generation_config.json.
    """
    directory = Path(model_dir)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{directory} has no config.json: point at a Hugging Face model directory "
            "(config.json plus *.safetensors)"
        )
    return merge_generation_eos(read_json(config_path), directory)


def merge_generation_eos(raw: dict[str, Any], directory: Path) -> dict[str, Any]:
    """raw with the EOS ids of the folder's generation_config.json (when it has one) added to its own."""
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        own = token_ids(raw.get("eos_token_id"))
        extra = token_ids(read_json(generation_path).get("eos_token_id"))
        raw["eos_token_id"] = [*own, *(t for t in extra if t not in own)]
    return raw


def llama_shape(raw: dict[str, Any], architecture: str) -> ModelConfig:
    """The fields every family reads as Llama does, with Llama's defaults; a family replaces the rest."""
    refuse_prequantized(raw)
    heads = positive_int(raw, "num_attention_heads")
    hidden = positive_int(raw, "hidden_size")
    head_dim = raw.get("head_dim") or hidden // heads
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads != 0:
        raise ModelLoadError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    max_pos = positive_int(raw, "max_position_embeddings")
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=architecture,
        vocab_size=positive_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=positive_int(raw, "intermediate_size"),
        num_hidden_layers=positive_int(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=rope_config(raw, rope_parameters(raw), max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=token_ids(raw.get("eos_token_id")),
        o_proj_bias=attention_bias,
        activation=activation(raw, "hidden_act"),
    )


SERVED_QUANT_METHODS = ("gguf", "awq", "gptq")
"""Pre-quantized checkpoints the loader reads: a GGUF export's safetensors are already floats, and
int4_checkpoint.py repacks AWQ/GPTQ's packed ints (and refuses their variants it does not read)."""


def refuse_prequantized(raw: dict[str, Any]) -> None:
    quant = raw.get("quantization_config") or {}
    if isinstance(quant, dict) and quant and quant.get("quant_method") not in SERVED_QUANT_METHODS:
        raise ModelLoadError(
            f"pre-quantized checkpoints (quant_method={quant.get('quant_method')!r}) are not supported: "
            "load a float, AWQ or GPTQ checkpoint, or a float one with quantization='int8' or 'nf4'"
        )


def activation(raw: dict[str, Any], key: str) -> str:
    name = raw.get(key, "silu")
    if name not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(
            f"{key}={name!r} is not supported; supported activations: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    return SUPPORTED_ACTIVATIONS[name]


def positive_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"config.json: {key}={value!r} must be a positive integer")
    return value


def token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    raise ModelLoadError(f"config.json: eos_token_id={value!r} must be an integer or a list of integers")


def windows_from_layer_types(raw: dict[str, Any], layers: int) -> tuple[int | None, ...] | None:
    """Per-layer windows from 5.x's `layer_types` list; None when the config has no such list."""
    types = raw.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layers:
        raise ModelLoadError(
            f"config.json: layer_types must list one type per layer ({layers}), not {types!r}"
        )
    unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise ModelLoadError(
            f"config.json: layer_types {unknown} are not supported: use full_attention or sliding_attention"
        )
    if "sliding_attention" not in types:
        return ()
    window = positive_int(raw, "sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types)


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE section of a config: 5.x's `rope_parameters`, else 4.x's `rope_scaling`, else empty."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"config.json: rope_parameters={params!r} must be an object")
    return params


def rope_config(raw: dict[str, Any], params: dict[str, Any], max_pos: int) -> RopeConfig:
    """One RoPE from its parameters (theta inside them in 5.x, beside them as `rope_theta` in 4.x)."""
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    theta = float(params.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"RoPE scaling type {rope_type!r} is not supported; supported types: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
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


def rotary_dim(raw: dict[str, Any], params: dict[str, Any], head_dim: int) -> int:
    """The rotated dims of each head from `partial_rotary_factor` (0: all of them)."""
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if not 0.0 < factor <= 1.0:
        raise ModelLoadError(f"config.json: partial_rotary_factor={factor} must be in (0, 1]")
    dims = int(head_dim * factor)
    if dims % 2:
        raise ModelLoadError(
            f"partial_rotary_factor={factor} rotates {dims} dims of {head_dim}: not an even count"
        )
    return 0 if dims == head_dim else dims
