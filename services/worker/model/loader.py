"""Load a model of any registered family from a local folder: config.json plus safetensors, or a GGUF file.

This module owns finding the weight files (one file, or shards named by model.safetensors.index.json,
or one *.gguf whose metadata is the config: gguf_file.py reads it, gguf_serving.py decides what of
it is served as stored; an AWQ/GPTQ checkpoint's int4 projections are repacked into ggml blocks by
int4_checkpoint.py and served the same way),
checking every tensor the family's config implies is there with the right shape, handing them to
the family for renaming and fusion (registry.py picks the family; it sees only the CausalLM and
Family interfaces of family.py), choosing the dtype by device, and optional quantization of the
decoder's projections: bitsandbytes int8 or nf4 (the GPU path), or the CPU int8 variant's modes
(torch's dynamic int8, or weight-only int8 at every batch size; CPU only, see dynamic_int8.py);
for a tensor-parallel rank, only its slice of the decoder (tensor_parallel.py splits the weights).
Every failure is a ModelLoadError that names the problem and the fix. It must never unpickle
anything (no .bin, no torch.load) nor run code shipped with a checkpoint (no trust_remote_code), and
never go online.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors import safe_open
from torch import Tensor

from services.worker.model.config import ModelLoadError, read_config
from services.worker.model.dynamic_int8 import (
    CPU_INT8_MODES,
    DYNAMIC_INT8,
    WEIGHT_ONLY_INT8,
    quantize_dynamic_int8,
    quantize_weight_only_int8,
)
from services.worker.model.gguf_file import find_gguf, read_gguf_config, read_gguf_tensors
from services.worker.model.gguf_serving import serve_stored
from services.worker.model.int4_checkpoint import INT4_TENSORS, Int4Scheme, int4_scheme, int4_weight
from services.worker.model.quant import QUANTIZATION_MODES, import_bitsandbytes, quantize_linears
from services.worker.model.registry import family_of
from services.worker.model.tensor_parallel import Shard, shard_config, split_weights

if TYPE_CHECKING:
    from services.worker.model.config import ModelConfig
    from services.worker.model.family import CausalLM, Family
    from services.worker.model.gguf_weight import GgufWeight

__all__ = ["LoadedModel", "ModelLoadError", "default_dtype", "load_model"]

_INDEX = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A ready model and what it was loaded as."""

    model: CausalLM
    config: ModelConfig
    path: Path
    dtype: torch.dtype
    device: torch.device
    quantization: str | None = None
    family: str = ""
    """The registry's name of the model's family ("llama", "qwen2", ...)."""
    weights_format: str = ""
    """How the weights are held: "float32", "float32, dynamic-int8", or a GGUF file's types."""


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA (tensor cores, half the memory); float32 elsewhere (CPU bf16 matmuls are slow)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    quantization: str | None = None,
    shard: Shard | None = None,
) -> LoadedModel:
    """Load the model in `path` onto `device`; raise ModelLoadError for anything unusable. With
    `shard`, only that tensor-parallel rank's slice of the decoder (tensor_parallel.py), whose
    config says so; its row-parallel projections are plain until tensor_parallel.reduce_rows."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(
            f"model path {directory} is not a directory: pass a Hugging Face model directory"
        )
    target = torch.device(device)
    dtype = dtype if dtype is not None else default_dtype(target)
    _check_quantization(quantization, target, dtype)
    bitsandbytes = quantization in QUANTIZATION_MODES
    if bitsandbytes and quantization is not None:
        import_bitsandbytes(quantization)
    gguf = _gguf_weights(directory, quantization)
    raw = read_config(directory) if gguf is None else read_gguf_config(gguf)
    family = family_of(raw)
    config = family.config(raw)
    scheme = int4_scheme(raw) if gguf is None else None
    if scheme is not None and quantization is not None:
        raise ModelLoadError(
            f"quantization={quantization!r} on a {scheme.describe()} checkpoint: it is served in the int4 "
            "it stores; leave quantization unset"
        )
    served_config = config
    if shard is not None and shard.size > 1:
        _check_shardable(directory, gguf, scheme, quantization)
        served_config = shard_config(config, shard)
    # bitsandbytes layers are built from CPU floats, so a float copy never lands on the accelerator.
    staging = torch.device("cpu") if bitsandbytes else target
    with torch.device("meta"):
        model = family.build(served_config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    # GgufWeight takes part in a family's conversion as a tensor-like (torch.cat only).
    if gguf is None:
        tensors = cast("dict[str, Tensor]", _read_tensors(directory, family, config, dtype, staging, scheme))
    else:
        tensors = cast("dict[str, Tensor]", read_gguf_tensors(gguf, family.checkpoint_names(config), dtype))
    converted = family.state_dict(tensors, config)
    if served_config is not config and shard is not None:
        converted = split_weights(converted, config, shard)
    for name, tensor in converted.items():
        if name not in expected:
            raise ModelLoadError(
                f"{directory}: the {family.name} family made a tensor {name} its model lacks"
            )
        if tuple(tensor.shape) != expected[name]:
            raise ModelLoadError(
                f"{directory}: tensor {name} has shape {tuple(tensor.shape)}, its config implies "
                f"{expected[name]}: the weights do not match the config"
            )
    if gguf is None and scheme is None:
        weights = converted
        weights_format = str(dtype).removeprefix("torch.") + (f", {quantization}" if quantization else "")
    else:
        served = serve_stored(
            model, converted, dtype, target, "GGUF" if scheme is None else scheme.describe()
        )
        weights, weights_format = served.weights, served.format
    model.load_state_dict(weights, strict=True, assign=True)
    if quantization == DYNAMIC_INT8:
        quantize_dynamic_int8(model)
    elif quantization == WEIGHT_ONLY_INT8:
        quantize_weight_only_int8(model)
    elif quantization is not None:
        quantize_linears(model, quantization, target, dtype)
    model.to(target)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(
        model, served_config, directory, dtype, target, quantization, family.name, weights_format
    )


def _check_shardable(
    directory: Path, gguf: Path | None, scheme: Int4Scheme | None, quantization: str | None
) -> None:
    """Tensor parallelism splits float weights only: quantized blocks would split inside a block."""
    held = "a GGUF file" if gguf is not None else scheme.describe() if scheme is not None else quantization
    if held is not None:
        raise ModelLoadError(
            f"{directory}: {held} cannot be split over tensor-parallel ranks yet; serve a float "
            "checkpoint (safetensors) with tensor_parallel_size > 1, or this one on one rank"
        )


def _check_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype) -> None:
    modes = (DYNAMIC_INT8, *QUANTIZATION_MODES, WEIGHT_ONLY_INT8)
    if quantization is not None and quantization not in modes:
        raise ModelLoadError(
            f"quantization={quantization!r} is not supported; use one of {', '.join(modes)} or None"
        )
    if quantization not in CPU_INT8_MODES:
        return
    if device.type != "cpu":
        raise ModelLoadError(
            f"quantization={quantization!r} runs on the CPU only (its int8 kernels are CPU ones), not on "
            f"{device}: on a GPU use quantization='nf4' (bitsandbytes) for the smaller model"
        )
    if dtype != torch.float32:
        raise ModelLoadError(
            f"quantization={quantization!r} computes in float32, not {dtype}: "
            "set dtype to float32 (or auto on the CPU)"
        )


def _gguf_weights(directory: Path, quantization: str | None) -> Path | None:
    """The folder's GGUF file when that is its weights; a folder with safetensors too is refused, and
    so is quantizing a GGUF again."""
    gguf = find_gguf(directory)
    if gguf is None:
        return None
    if any(directory.glob("*.safetensors")):
        raise ModelLoadError(
            f"{directory} holds both {gguf.name} and safetensors weights: keep one set of weights per "
            "model folder (move the other to a folder of its own)"
        )
    if quantization is not None:
        raise ModelLoadError(
            f"quantization={quantization!r} on {gguf.name}: a GGUF file is served in the types it stores; "
            "leave quantization unset, or use a smaller GGUF file (Q4_K_M of a Q8_0, say) as the fallback"
        )
    return gguf


def _weight_files(directory: Path) -> list[Path]:
    index = directory / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{index} is unreadable or has no weight_map: {err}") from err
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{directory}: shard(s) {', '.join(missing)} named by {_INDEX} are missing: "
                "download them again"
            )
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{directory} holds only pickle checkpoints ({', '.join(pickles)}); safetensors are required "
            "(pickle files can run arbitrary code when loaded): convert the checkpoint to *.safetensors "
            "on a trusted machine and retry"
        )
    raise ModelLoadError(
        f"{directory} has no weights: expected model.safetensors or shards listed in {_INDEX}"
    )


def _read_tensors(
    directory: Path,
    family: Family,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    scheme: Int4Scheme | None,
) -> dict[str, Tensor | GgufWeight]:
    """Every tensor the config names; with an int4 scheme, a `<name>.weight` may be stored as its
    `<name>.qweight`, `.qzeros`, `.scales` (and `.g_idx`), read as the GgufWeight they pack."""
    names = family.checkpoint_names(config)
    wanted = set(names)
    packed_names = {
        f"{n.removesuffix('weight')}{t}": n for n in names if n.endswith(".weight") for t in INT4_TENSORS
    }
    found: dict[str, Tensor | GgufWeight] = {}
    packed: dict[str, dict[str, Tensor]] = {}
    unexpected: list[str] = []
    files = _weight_files(directory)
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    if key in wanted:
                        found[key] = handle.get_tensor(key).to(device=device, dtype=dtype)
                    elif scheme is not None and key in packed_names:
                        kind = key.rpartition(".")[2]  # qweight, qzeros, scales or g_idx
                        packed.setdefault(packed_names[key], {})[kind] = handle.get_tensor(key)
                    elif key != "lm_head.weight" and not key.endswith(family.ignored_suffixes):
                        unexpected.append(key)
        except (OSError, RuntimeError, ValueError) as err:
            raise ModelLoadError(f"cannot read {file}: {err}: it is corrupt or not safetensors") from err
    if scheme is not None:
        if not packed:
            raise ModelLoadError(
                f"{directory}: config.json declares {scheme.describe()} weights but the safetensors hold "
                "no qweight tensors: drop quantization_config from config.json, or use the packed files"
            )
        found.update({name: int4_weight(scheme, parts, name) for name, parts in packed.items()})
    missing = [n for n in names if n not in found]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ModelLoadError(
            f"{directory}: the safetensors ({', '.join(f.name for f in files)}) lack tensor(s) {shown} "
            "that config.json requires: the checkpoint is incomplete or does not match its config"
        )
    if unexpected:
        raise ModelLoadError(
            f"{directory}: unexpected tensor(s) {', '.join(unexpected[:5])}: the checkpoint is not a plain "
            f"{config.architecture} as its config.json claims"
        )
    return found
