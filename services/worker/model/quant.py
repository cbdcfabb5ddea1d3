"""Optional bitsandbytes quantization of the decoder layers' linear projections (int8 or nf4).

This module owns the one place bitsandbytes is imported, lazily, so the service runs without it and
fails with a clear message when quantization is asked for but the package is missing. The
embeddings, norms and the vocabulary projection stay in the model dtype: they are a small share of
the weights and the most sensitive to rounding. It must not read checkpoints or choose a device.

bitsandbytes quantizes a layer when the layer moves to its device, so the loader keeps the float
weights on the CPU until `quantize_linears` has moved them; a float copy never sits on the GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.model.config import ModelLoadError

if TYPE_CHECKING:
    from types import ModuleType

QUANTIZATION_MODES = ("int8", "nf4")
_QUANTIZED_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def validate_quantization(mode: str | None) -> None:
    """Raise ModelLoadError for a mode that is neither None nor one of QUANTIZATION_MODES."""
    if mode is not None and mode not in QUANTIZATION_MODES:
        raise ModelLoadError(
            f"quantization={mode!r} is not supported; use one of {', '.join(QUANTIZATION_MODES)} or None"
        )


def import_bitsandbytes(mode: str) -> ModuleType:
    """Import bitsandbytes or explain how to get it."""
    try:
        import bitsandbytes
    except ImportError as err:
        raise ModelLoadError(
            f"quantization={mode!r} needs the bitsandbytes package, which is not installed: "
            "`pip install bitsandbytes` (a CUDA GPU is its main target), or load without quantization"
        ) from err
    module: ModuleType = bitsandbytes
    return module


def quantize_linears(model: nn.Module, mode: str, device: torch.device, compute_dtype: torch.dtype) -> int:
    """Replace every decoder-layer projection by its bitsandbytes twin on `device`; return the count."""
    validate_quantization(mode)
    bnb = import_bitsandbytes(mode)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if name in _QUANTIZED_LAYERS and isinstance(child, nn.Linear)
    ]
    for parent, name, linear in targets:
        setattr(parent, name, _quantized_twin(bnb, linear, mode, device, compute_dtype))
    return len(targets)


def _quantized_twin(
    bnb: ModuleType, linear: nn.Linear, mode: str, device: torch.device, compute_dtype: torch.dtype
) -> nn.Module:
    has_bias = linear.bias is not None
    twin: nn.Module
    if mode == "int8":
        # has_fp16_weights=False keeps only the int8 weights; 6.0 is LLM.int8()'s outlier threshold.
        twin = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False, threshold=6.0
        )
    else:
        twin = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            compute_dtype=compute_dtype,
            compress_statistics=False,
            quant_type="nf4",
        )
    twin.load_state_dict(linear.state_dict())
    twin.requires_grad_(False)
    return twin.to(device)
