"""AWQ and GPTQ int4 checkpoints packed as the formats' own packers pack them, for the loader's tests.

`write_int4` takes a tiny float checkpoint (tests/conftest.py's), quantizes every decoder projection
by round-to-nearest per group (scale = (max - min) / 15 in float16, zero = round(-min / scale); or
symmetric, zero 8 and scale = max|w| / 7.5), and writes it as AutoAWQ's GEMM layout or AutoGPTQ's
(checkpoint_format "gptq", zeros stored minus one, or "gptq_v2"), optionally act-order: each input's
columns are quantized in a seeded random order and g_idx says each column's group, the same order for
the projections of one input (q/k/v, gate/up) as GPTQ's shared Hessian gives them. Beside it, the
reference folder holds the same model with each projection the float32 (q - zero) * scale it packed,
so a test holds the loaded int4 checkpoint to dequantize-then-matmul. The packing follows the
formats' published descriptions (AutoAWQ's nibble order 0, 2, 4, 6, 1, 3, 5, 7 within a word;
AutoGPTQ's eight input rows per word), written here independently of the loader's unpacking.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from pathlib import Path

    from torch import Tensor

_AWQ_PACK = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8j + _AWQ_PACK[i]
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_INPUT_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


@dataclass(frozen=True, slots=True)
class Int4Layout:
    method: str  # "awq" or "gptq"
    group_size: int = 128
    symmetric: bool = False
    act_order: bool = False
    checkpoint_format: str = "gptq"  # GPTQ only: "gptq" stores zero - 1, "gptq_v2" the zero


@dataclass(frozen=True, slots=True)
class Quantized:
    """One projection quantized: its packed tensors and its dequantized float32 [out, in]."""

    tensors: dict[str, Tensor]
    dequantized: Tensor


def _pack_rows(values: np.ndarray) -> np.ndarray:
    """[..., 8n] of 0..15 -> int32 [..., n], value 8j + i in bits 4i..4i+3 of word j."""
    grouped = values.astype(np.uint32).reshape(*values.shape[:-1], -1, 8)
    words = np.zeros(grouped.shape[:-1], dtype=np.uint32)
    for i in range(8):
        words |= grouped[..., i] << np.uint32(4 * i)
    return words.view(np.int32)


def quantize(weight: Tensor, layout: Int4Layout, order: Tensor | None = None) -> Quantized:
    """`weight` [out, in] float -> its packed tensors in `layout` and the float32 they stand for;
    `order` (a permutation of the inputs) is the act-order in which columns fill groups."""
    out_features, in_features = weight.shape
    size = in_features if layout.group_size < 0 else layout.group_size
    order = torch.arange(in_features) if order is None else order
    groups = torch.empty(in_features, dtype=torch.int64)
    groups[order] = torch.arange(in_features) // size
    w = weight.to(torch.float32).T  # [in, out], the layout of both formats
    scales = torch.empty(in_features // size, out_features)
    zeros = torch.empty(in_features // size, out_features)
    for g in range(in_features // size):
        block = w[groups == g]
        if layout.symmetric:
            scale, zero = block.abs().amax(0) / 7.5, torch.full((out_features,), 8.0)
        else:
            low, high = block.amin(0).clamp(max=0), block.amax(0).clamp(min=0)
            scale = (high - low) / 15
            # AutoGPTQ's own format cannot store a zero of 0 (it stores zero - 1 in four bits).
            floor = 1 if layout.method == "gptq" and layout.checkpoint_format == "gptq" else 0
            zero = torch.round(-low / scale.half().float()).clamp(floor, 15)
        scales[g], zeros[g] = scale.half().float(), zero
    q = torch.clamp(torch.round(w / scales[groups]) + zeros[groups], 0, 15)
    dequantized = ((q - zeros[groups]) * scales[groups]).T.contiguous()
    qn, zn = q.to(torch.int64).numpy(), zeros.to(torch.int64).numpy()
    tensors = {"scales": scales.half()}
    if layout.method == "awq":
        tensors["qweight"] = torch.from_numpy(_pack_rows(qn[:, _awq_columns(out_features)]))
        tensors["qzeros"] = torch.from_numpy(_pack_rows(zn[:, _awq_columns(out_features)]))
    else:
        tensors["qweight"] = torch.from_numpy(_pack_rows(qn.T).T.copy())
        stored = zn - (1 if layout.checkpoint_format == "gptq" else 0)
        tensors["qzeros"] = torch.from_numpy(_pack_rows(stored))
        tensors["g_idx"] = groups.to(torch.int32)
    return Quantized(tensors, dequantized)


def _awq_columns(out_features: int) -> np.ndarray:
    """The column order whose plain sequential packing is AWQ's: position 8j + i is column 8j + pack[i]."""
    return (np.arange(out_features).reshape(-1, 8)[:, list(_AWQ_PACK)]).reshape(-1)


def write_int4(checkpoint: Path, out: Path, reference: Path, layout: Int4Layout, seed: int = 0) -> Path:
    """The int4 checkpoint of `checkpoint` in `out` and its dequantized float32 twin in `reference`."""
    config = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    packed: dict[str, Tensor] = {}
    dense: dict[str, Tensor] = {}
    orders: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        projection = next((p for p in _PROJECTIONS if name.endswith(f".{p}.weight")), None)
        if projection is None:
            packed[name] = dense[name] = tensor.contiguous()
            continue
        order = None
        if layout.act_order:
            key = name.removesuffix(f"{projection}.weight") + _INPUT_OF.get(projection, projection)
            if key not in orders:
                orders[key] = torch.randperm(tensor.shape[1], generator=generator)
            order = orders[key]
        quantized = quantize(tensor, layout, order)
        base = name.removesuffix("weight")
        packed.update({base + kind: t.contiguous() for kind, t in quantized.tensors.items()})
        dense[name] = quantized.dequantized
    for folder, weights in ((out, packed), (reference, dense)):
        folder.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(checkpoint / "config.json", folder / "config.json")
    config["quantization_config"] = quantization_config(layout)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def quantization_config(layout: Int4Layout) -> dict[str, object]:
    if layout.method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": layout.group_size,
            "zero_point": True,
            "version": "gemm",
        }
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": layout.group_size,
        "desc_act": layout.act_order,
        "sym": layout.symmetric,
        "checkpoint_format": layout.checkpoint_format,
    }
