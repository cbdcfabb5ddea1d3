"""Tiny GGUF model files written as llama.cpp's converter writes them, for the loader's tests.

`write_gguf` takes a tiny transformers checkpoint (tests/conftest.py's) and writes one GGUF file with
its config as llama.cpp's metadata keys, its tensors under GGUF names, the q/k rows of a Llama-arch
file permuted the way llama.cpp's converter permutes them (its RoPE pairs neighbouring dimensions),
norms and biases in F32 and each projection in the type `qtype_of` picks: quantized by the gguf
package where it can, random valid blocks for the k-quants (tests/gguf_blocks.py). transformers
reads the same file back as the independent reference.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map, quants
from safetensors.numpy import load_file

from tests.gguf_blocks import QUANTIZABLE, random_blocks

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

_ARCHES = {"llama": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2}


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: per head, the two halves interleaved."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    checkpoint: Path, out: Path, arch: str, qtype_of: Callable[[str], GGMLQuantizationType]
) -> Path:
    """A GGUF file at `out` of the transformers checkpoint in `checkpoint` (see the module docstring)."""
    config = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    layers = int(config["num_hidden_layers"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    writer = GGUFWriter(str(out), arch)
    writer.add_block_count(layers)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(int(config["vocab_size"]))
    names = get_tensor_name_map(_ARCHES[arch], layers)
    for seed, (name, tensor) in enumerate(sorted(tensors.items())):
        stored = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert stored is not None, name
        values = tensor.astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            values = _permute(values, heads if ".q_proj." in name else kv_heads)
        qtype = qtype_of(name) if values.ndim == 2 else GGMLQuantizationType.F32
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(stored, values)
        else:
            if qtype in QUANTIZABLE:
                blocks = quants.quantize(values, qtype)
            else:
                rows, cols = values.shape
                blocks = random_blocks(qtype, rows, cols, seed)
            writer.add_tensor(stored, np.asarray(blocks), raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
