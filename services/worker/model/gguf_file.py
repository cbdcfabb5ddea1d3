"""Reading a GGUF file: the model's config from its metadata and its tensors under our checkpoint names.

A model folder whose weights are one `*.gguf` file is served from that file as shipped. The config
comes from the file's metadata through transformers' GGUF metadata reader (`load_gguf_checkpoint`
without tensors: the same mapping of llama.cpp's keys to config.json's that transformers uses), with
generation_config.json's end-of-turn ids merged when the folder has one. Tensors are found through
the `gguf` package's name map (transformers' `model.layers.N.self_attn.q_proj.weight` is
`blk.N.attn_q.weight`) and read from the memory-mapped file: float types (F32, F16, BF16) as tensors
of the engine's dtype, every quantized type as a GgufWeight of the bytes as stored. Two exporter
transforms are undone so that the tensors mean what a transformers checkpoint's mean: llama.cpp
permutes the rows of Llama-architecture q and k projections (its RoPE pairs neighbours, transformers'
halves), and stores Gemma's norms as 1 + w.

This module owns reading GGUF files; it must not choose a family (registry.py does), build modules or
decide what is dequantized (the loader does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, get_tensor_name_map

from services.worker.model.config import ModelLoadError, merge_generation_eos
from services.worker.model.gguf_weight import FLOAT_TYPES, GgufPart, GgufWeight

if TYPE_CHECKING:
    from pathlib import Path

    from gguf import ReaderTensor
    from torch import Tensor

# Architectures whose q/k rows llama.cpp's converter permutes (Mistral GGUFs say "llama" too).
_PERMUTED_QK = ("llama",)
# Architectures whose norms the converter stores as 1 + w.
_NORMS_PLUS_ONE = ("gemma2", "gemma3")


def find_gguf(directory: Path) -> Path | None:
    """The one *.gguf in a model folder, None when there is none; refuses a folder with several."""
    files = sorted(directory.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ModelLoadError(
            f"{directory} holds several GGUF files ({names}): keep one model file per folder"
        )
    return files[0] if files else None


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}: it is corrupt or not a GGUF file") from err


def architecture(reader: GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError("the GGUF file has no general.architecture: it is not a model file")
    return str(bytes(field.parts[field.data[0]]), encoding="utf-8")


def read_gguf_config(path: Path) -> dict[str, Any]:
    """config.json's fields from the file's metadata (plus the folder's generation_config.json ids)."""
    # transformers' reader of GGUF metadata: the one kept mapping of llama.cpp keys to config fields.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)  # type: ignore[no-untyped-call]
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"cannot read the model config in {path}'s metadata: {err}") from err
    return merge_generation_eos(dict(parsed["config"]), path.parent)


def read_gguf_tensors(path: Path, names: list[str], dtype: torch.dtype) -> dict[str, Tensor | GgufWeight]:
    """Each checkpoint name in `names` read from the file (see the module docstring)."""
    reader = open_gguf(path)
    arch = architecture(reader)
    by_name = {t.name: t for t in reader.tensors}
    name_map = get_tensor_name_map(_arch_enum(arch, path), _block_count(reader, arch))
    heads = _heads(reader, arch)
    found: dict[str, Tensor | GgufWeight] = {}
    missing: list[str] = []
    for name in names:
        stored = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        tensor = by_name.get(stored) if stored is not None else None
        if tensor is None:
            missing.append(f"{name} ({stored or 'no GGUF name'})")
            continue
        value = _read(tensor, dtype)
        if arch in _PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
            value = _unpermute(value, heads[0] if ".q_proj." in name else heads[1])
        if arch in _NORMS_PLUS_ONE and "norm.weight" in name and isinstance(value, torch.Tensor):
            value = value - 1
        found[name] = value
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ModelLoadError(
            f"{path} lacks tensor(s) {shown} that its metadata's config requires: the file is incomplete "
            "or another architecture than its metadata says"
        )
    return found


def _arch_enum(arch: str, path: Path) -> Any:
    for key, value in MODEL_ARCH_NAMES.items():
        if value == arch:
            return key
    raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is unknown to the gguf package")


def _block_count(reader: GGUFReader, arch: str) -> int:
    field = reader.fields.get(f"{arch}.block_count")
    if field is None:
        raise ModelLoadError(f"the GGUF file has no {arch}.block_count")
    return int(field.parts[field.data[0]][0])


def _heads(reader: GGUFReader, arch: str) -> tuple[int, int]:
    """(attention heads, KV heads) from the metadata; KV heads default to the heads."""

    def value(key: str) -> int | None:
        field = reader.fields.get(f"{arch}.{key}")
        return int(field.parts[field.data[0]][0]) if field is not None else None

    heads = value("attention.head_count") or 0
    return heads, value("attention.head_count_kv") or heads


def _read(tensor: ReaderTensor, dtype: torch.dtype) -> Tensor | GgufWeight:
    qtype = GGMLQuantizationType(tensor.tensor_type)
    # ggml lists dimensions innermost first: [cols, rows] is a [rows, cols] matrix.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    data = np.asarray(tensor.data)
    if qtype in FLOAT_TYPES:
        if qtype == GGMLQuantizationType.BF16:
            floats = torch.from_numpy(data.copy()).view(torch.bfloat16)
        else:
            floats = torch.from_numpy(data.copy())
        return floats.reshape(shape).to(dtype)
    if len(shape) != 2:
        raise ModelLoadError(f"GGUF tensor {tensor.name} is {qtype.name} with shape {shape}: expected 2-D")
    # A copy: the reader's memory map is closed with it, and parts outlive it.
    return GgufWeight([GgufPart(qtype, torch.from_numpy(data.copy()).reshape(shape[0], -1))])


def _unpermute(value: Tensor | GgufWeight, heads: int) -> Tensor | GgufWeight:
    """Undo llama.cpp's q/k row permutation (per head, rows 2i and 2i+1 back to i and i + half)."""
    rows = value.shape[0]
    half = rows // heads // 2
    order = torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)
    if isinstance(value, GgufWeight):
        return value.rows_reordered(order)
    return value[order].contiguous()
