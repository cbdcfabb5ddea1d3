"""What of a GGUF model (or of an AWQ/GPTQ checkpoint, repacked into ggml blocks) is served in its
stored types, and what is dequantized at load.

A weight is served as stored where a native kernel computes from its blocks. On the CPU (the kernels
loaded, float32 activations, a kernel for every part's type) a decoder projection or an untied
vocabulary projection becomes a GgufLinear, the token embeddings a GgufEmbedding (and, in a tied
model, the vocabulary projection a GgufLinear over the same buffers). On a CUDA device of compute
capability 8.0 or later with bfloat16 activations, a projection of Q4_0/Q4_1 blocks (every AWQ and
GPTQ projection, a GGUF file's Q4_0 and Q4_1 ones) becomes a TinygemmLinear (int4_cuda.py). Every other
quantized weight is dequantized once, at load, to the engine's dtype, and the loader says so in one
warning that names each type and how many weights it covers, so a type without a kernel is never
slow in silence. This module owns that decision and the module swap; it must not read files
(gguf_file.py does) nor hold kernels (gguf_linear.py calls them).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.model import native
from services.worker.model.gguf_linear import GgufEmbedding, GgufLinear, supported
from services.worker.model.gguf_weight import GgufWeight
from services.worker.model.int4_cuda import TinygemmLinear, kernel_available, servable

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import Tensor

    from services.worker.model.family import CausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Served:
    """What serve_stored left for `load_state_dict`, and how the weights are held, in words."""

    weights: dict[str, Tensor]
    format: str
    """"GGUF as stored: Q4_K x48, Q6_K x13; dequantized to float32: Q2_K x3", say."""


def serve_stored(
    model: CausalLM,
    stored: Mapping[str, Tensor | GgufWeight],
    dtype: torch.dtype,
    device: torch.device,
    source: str = "GGUF",
) -> Served:
    """Swap in stored-type modules where they apply; return the state dict left for `load_state_dict`
    (dense tensors, with the swapped modules' own buffers) and the weights' format, which begins with
    `source` (the checkpoint's kind: "GGUF", "AWQ int4 (groups of 128)")."""
    kernels = native.library() if device.type == "cpu" and dtype == torch.float32 else None
    int4_on_device = dtype == torch.bfloat16 and kernel_available(device)
    dequantized: Counter[str] = Counter()
    kept: Counter[str] = Counter()
    weights: dict[str, Tensor] = {}
    swapped: dict[str, nn.Module] = {}
    for name, value in stored.items():
        if not isinstance(value, GgufWeight):
            weights[name] = value
            continue
        path = name.removesuffix(".weight")
        current = model.get_submodule(path)
        cpu_servable = isinstance(current, nn.Linear) or (
            isinstance(current, nn.Embedding) and value.input_order is None
        )
        bias = stored.get(f"{path}.bias")
        if kernels is not None and cpu_servable and supported(value, kernels):
            swapped[path] = _stored_module(current, value, bias)
            kept[value.describe()] += 1
        elif int4_on_device and isinstance(current, nn.Linear) and servable(value):
            swapped[path] = TinygemmLinear.from_weight(value, _dense(bias, dtype), device)
            kept[value.describe()] += 1
        else:
            dequantized[value.describe()] += 1
            weights[name] = value.dequantize(dtype)
    for path, module in swapped.items():
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
        weights.pop(f"{path}.bias", None)
        weights.update({f"{path}.{key}": tensor for key, tensor in module.state_dict().items()})
    embeddings = swapped.get("embed_tokens")
    if isinstance(embeddings, GgufEmbedding) and model.config.tie_word_embeddings:
        # The tied vocabulary projection reads the embedding's own blocks: no second copy.
        head = GgufLinear(embeddings.stored_weight())
        model.lm_head = head
        weights.update({f"lm_head.{key}": tensor for key, tensor in head.state_dict().items()})
    dense = str(dtype).removeprefix("torch.")
    if dequantized:
        log.warning(
            "%s weights dequantized at load to %s (no native kernel serves them as stored here): %s",
            source,
            dense,
            _counts(dequantized),
        )
    described = [f"as stored: {_counts(kept)}"] if kept else []
    described += [f"dequantized to {dense}: {_counts(dequantized)}"] if dequantized else []
    return Served(weights, f"{source} " + "; ".join(described or ["of float tensors only"]))


def _counts(kinds: Counter[str]) -> str:
    return ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items()))


def _dense(bias: Tensor | GgufWeight | None, dtype: torch.dtype) -> Tensor | None:
    return bias.dequantize(dtype) if isinstance(bias, GgufWeight) else bias


def _stored_module(current: nn.Module, weight: GgufWeight, bias: Tensor | GgufWeight | None) -> nn.Module:
    if isinstance(current, nn.Embedding):
        return GgufEmbedding(weight)
    return GgufLinear(weight, _dense(bias, torch.float32))
