"""AWQ and GPTQ int4 checkpoints read into ggml blocks, so the GGUF kernels serve them as stored.

A projection of an AWQ (AutoAWQ's GEMM layout) or GPTQ checkpoint is stored as `qweight` (eight
4-bit values per int32), `qzeros` (packed the same way), `scales` (float16, one per output row and
group of `group_size` input columns) and, for GPTQ, `g_idx` (each input column's group); a weight is
(q - zero) * scale. Every 32 input columns of one output row inside one group are exactly one ggml
Q4_1 block (d = scale, m = -zero * scale, which the block stores in float16: within 2^-11 of the
product, under a thousandth of a quantization step per zero), or a Q4_0 block (d = scale and its
fixed zero of 8, exact) when every zero of the tensor is 8, as a symmetric quantization stores. A
group of 32, 64 or 128 columns is 1, 2 or 4 blocks of the same scale. A GPTQ checkpoint quantized
with act-order (desc_act) numbers its groups in an order other than its columns': the columns are
sorted by group, and the projection multiplies x taken in that order (`GgufWeight.input_order`).

Layouts, as AutoAWQ's and AutoGPTQ's packers write them:
- AWQ: qweight int32 [in, out / 8], the nibbles 0..7 of word j holding output columns
  8j + (0, 2, 4, 6, 1, 3, 5, 7); qzeros int32 [groups, out / 8] packed the same way; scales
  [groups, out].
- GPTQ: qweight int32 [in / 8, out], nibble i of row r holding input column 8r + i; qzeros int32
  [groups, out / 8], nibble i of word j holding output column 8j + i, stored as zero - 1 by
  checkpoint_format "gptq" (AutoGPTQ's) and as the zero by "gptq_v2"; scales [groups, out];
  g_idx int32 [in].

This module owns reading a checkpoint's quantization_config and that repacking; it must not read
files (the loader does) nor decide what is served as stored (gguf_serving.py does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from services.worker.model.config import ModelLoadError
from services.worker.model.gguf_weight import GgufPart, GgufWeight

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import Tensor

INT4_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
"""The tensors that stand for one quantized `<name>.weight` as `<name>.qweight`, ...; g_idx is GPTQ's."""

_AWQ_UNPACK = (0, 4, 1, 5, 2, 6, 3, 7)  # column k of a word is its nibble _AWQ_UNPACK[k]
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what its stored zeros lack
_BLOCK = 32


@dataclass(frozen=True, slots=True)
class Int4Scheme:
    """How a checkpoint's int4 projections are packed (its config.json's quantization_config)."""

    method: str
    """"awq" or "gptq"."""
    group_size: int
    """Input columns per scale; -1 (one group per row) is read as the whole row."""
    zero_offset: int
    """Added to every stored zero: 1 for AutoGPTQ's format, which stores zero - 1."""

    def describe(self) -> str:
        groups = "one group per row" if self.group_size < 0 else f"groups of {self.group_size}"
        return f"{self.method.upper()} int4 ({groups})"


def int4_scheme(raw: dict[str, Any]) -> Int4Scheme | None:
    """The int4 scheme a parsed config.json declares, None for a float checkpoint, or a ModelLoadError
    naming what of an AWQ/GPTQ configuration is not served."""
    quant = raw.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") not in ("awq", "gptq"):
        return None
    method = str(quant["quant_method"])
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        raise ModelLoadError(
            f"{method} checkpoint with bits={bits!r}: only 4-bit AWQ/GPTQ is served; use a 4-bit "
            "quantization of the model, or its float checkpoint"
        )
    group_size = quant.get("group_size", quant.get("q_group_size", 128))
    if not isinstance(group_size, int) or (group_size != -1 and (group_size <= 0 or group_size % _BLOCK)):
        raise ModelLoadError(
            f"{method} checkpoint with group_size={group_size!r}: groups must be a multiple of {_BLOCK} "
            "input columns (32, 64, 128) or -1 for one group per row"
        )
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm" or quant.get("zero_point") is False:
            raise ModelLoadError(
                f"AWQ checkpoint with version={version!r}, zero_point={quant.get('zero_point')!r}: only "
                "AutoAWQ's GEMM layout with zero points is read; export the model with version='gemm'"
            )
        return Int4Scheme(method, group_size, 0)
    checkpoint_format = str(quant.get("checkpoint_format", "gptq"))
    if checkpoint_format not in _GPTQ_FORMATS:
        raise ModelLoadError(
            f"GPTQ checkpoint with checkpoint_format={checkpoint_format!r}: only "
            f"{', '.join(_GPTQ_FORMATS)} are read; convert it to one of them"
        )
    return Int4Scheme(method, group_size, _GPTQ_FORMATS[checkpoint_format])


def int4_weight(scheme: Int4Scheme, tensors: Mapping[str, Tensor], name: str) -> GgufWeight:
    """The projection `name` ([out, in]) from its qweight, qzeros, scales (and g_idx) as ggml blocks."""
    try:
        quants, zeros = _unpack(scheme, tensors)
        scales = tensors["scales"].to(torch.float32)
    except (KeyError, RuntimeError) as err:
        raise ModelLoadError(
            f"{name}: its {scheme.method} tensors are incomplete or of the wrong shapes ({err}); the "
            "checkpoint does not match its quantization_config"
        ) from err
    out_features, in_features = quants.shape
    if zeros.shape != scales.shape or scales.shape[1:] != (out_features,):
        raise ModelLoadError(
            f"{name}: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not fit a weight of "
            f"{out_features} outputs: the checkpoint does not match its quantization_config"
        )
    groups = _column_groups(scheme, tensors, in_features, scales.shape[0], name)
    order = torch.argsort(groups, stable=True)
    if torch.equal(order, torch.arange(in_features)):
        input_order = None
    else:
        input_order, quants, groups = order, quants[:, order], groups[order]
    counts = torch.bincount(groups)
    if in_features % _BLOCK or bool((counts % _BLOCK).any()):
        raise ModelLoadError(
            f"{name}: groups of {sorted(set(counts.tolist()))} columns and {in_features} input "
            f"columns: every group must be a multiple of {_BLOCK} columns to be served as blocks"
        )
    block_groups = groups[::_BLOCK]
    block_scales = scales[block_groups].T.contiguous()  # [out, blocks]
    block_zeros = zeros[block_groups].T.contiguous()
    nibbles = _block_nibbles(quants)
    d = block_scales.numpy().astype(np.float16)
    if bool((block_zeros == 8).all()):
        qtype, heads = GGMLQuantizationType.Q4_0, [d]
    else:
        m = (-block_zeros.to(torch.float32) * block_scales).numpy().astype(np.float16)
        qtype, heads = GGMLQuantizationType.Q4_1, [d, m]
    head_bytes = [h.reshape(out_features, -1, 1).view(np.uint8) for h in heads]
    blocks = np.concatenate([*head_bytes, nibbles], axis=2).reshape(out_features, -1)
    part = GgufPart(qtype, torch.from_numpy(np.ascontiguousarray(blocks)))
    return GgufWeight([part], input_order)


def _nibbles(words: Tensor) -> Tensor:
    """int32 [..., w] -> its eight 4-bit values per word, low nibble first: int16 [..., w, 8]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.int16)


def _unpack(scheme: Int4Scheme, tensors: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(quants int16 [out, in], zeros int16 [groups, out]) as the format means them."""
    zeros = _nibbles(tensors["qzeros"])
    if scheme.method == "awq":
        unpack = torch.tensor(_AWQ_UNPACK)
        quants = _nibbles(tensors["qweight"])[..., unpack].flatten(1).T
        zeros = zeros[..., unpack]
    else:
        packed = _nibbles(tensors["qweight"])  # [in / 8, out, 8]: nibble i is input 8r + i
        quants = packed.permute(1, 0, 2).flatten(1)
    return quants.contiguous(), zeros.flatten(1) + scheme.zero_offset


def _column_groups(
    scheme: Int4Scheme, tensors: Mapping[str, Tensor], in_features: int, groups: int, name: str
) -> Tensor:
    """Each input column's group (int64 [in])."""
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        column_groups = g_idx.to(torch.int64)
    else:
        size = in_features if scheme.group_size < 0 else scheme.group_size
        column_groups = torch.arange(in_features) // size
    if column_groups.shape != (in_features,) or int(column_groups.min()) < 0:
        raise ModelLoadError(f"{name}: g_idx has shape {tuple(column_groups.shape)}, not ({in_features},)")
    if int(column_groups.max()) >= groups:
        raise ModelLoadError(
            f"{name}: its columns name group {int(column_groups.max())} but scales hold {groups} groups: "
            "the checkpoint's group_size does not match its tensors"
        )
    return column_groups


def _block_nibbles(quants: Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """quants [out, in] (0..15) -> ggml's 16 bytes per 32: byte j holds value j low, value j + 16 high."""
    out_features, in_features = quants.shape
    values = quants.to(torch.uint8).reshape(out_features, in_features // _BLOCK, 2, _BLOCK // 2)
    packed = values[:, :, 0] | (values[:, :, 1] << 4)
    return packed.numpy()
