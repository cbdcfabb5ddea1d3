"""A decode-only step at a few rows through every decoder layer in one native call (csrc/decode_stack.cpp).

At one to small_linear.MAX_ROWS decodes on the CPU in float32, a step's kernels read the weights at
the memory's bandwidth, and what is left is Python: about ten calls, allocations and ctypes
crossings per layer. This module owns the choice to skip them (a decode-only step of at most
MAX_ROWS rows, on a model whose every layer the native path can run, its projections float32, int8
copies or GGUF blocks: the model's `stack_layers` gives them in Llama's shape, or None; its KV cache
float32 or int8, kv_format.py's rows) and the ctypes views of the layers' weights and cache it
passes, built once per model and cache and reused every step. The views hold a reference to every
tensor they point to, so none can be freed (and its address reused) under them; a model's weights
must not be replaced after its first step. The native stack calls the same kernels in the same order
as the per-operator path in layers.py, so both give the same bits; it must not change any
arithmetic.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from services.worker.model.gguf_linear import GgufLinear
from services.worker.model.lora_file import PROJECTIONS
from services.worker.model.small_int8 import WeightOnlyInt8
from services.worker.model.small_linear import MAX_ROWS

if TYPE_CHECKING:
    from services.worker.model import native
    from services.worker.model.attention import AttentionMetadata
    from services.worker.model.config import ModelConfig
    from services.worker.model.family import CausalLM
    from services.worker.model.kv_cache import KVCache
    from services.worker.model.lora import LoraLayer, LoraRows

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_enabled = True


def set_enabled(enabled: bool) -> bool:
    """Turn the native stack on or off for this process (benchmarks compare both); returns the old state.

    Off, every step takes the per-operator path, whose kernels stay on (native.set_enabled owns those).
    """
    global _enabled
    previous, _enabled = _enabled, enabled
    return previous


_MAX_GGUF_PARTS = 3


class _Projection(ctypes.Structure):
    _fields_ = (
        ("weight", _P),
        ("scale", _P),
        ("bias", _P),
        ("out_features", _I64),
        ("in_features", _I64),
        ("gguf_parts", _I64),
        ("gguf_types", _I64 * _MAX_GGUF_PARTS),
        ("gguf_blocks", _P * _MAX_GGUF_PARTS),
        ("gguf_rows", _I64 * _MAX_GGUF_PARTS),
        ("lora_a", _P),
        ("lora_bt", _P),
        ("lora_rank", _I64),
        ("lora_bands", _P),
        ("lora_num_bands", _I64),
    )


class _Layer(ctypes.Structure):
    _fields_ = (
        ("input_norm", _P),
        ("post_attention_norm", _P),
        ("qkv", _Projection),
        ("o", _Projection),
        ("gate_up", _Projection),
        ("down", _Projection),
        ("keys", _P),
        ("values", _P),
    )


class _Step(ctypes.Structure):
    _fields_ = (
        *((name, _I64) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        ("eps", _F32),
        ("attention_scale", _F32),
        *((name, _P) for name in ("cos", "sin", "block_tables", "seq_lens", "slots")),
        ("table_width", _I64),
        ("block_size", _I64),
        ("kv_format", _I64),
        ("lora_rows", _P),
        ("lora_order", _P),
        ("lora_count", _I64),
        ("lora_scratch", _P),
    )


def _projection(module: nn.Module, held: list[Tensor]) -> _Projection | None:
    """The native view of one projection (its tensors added to `held`), or None when the native stack
    cannot run it."""
    weight: Tensor
    scale: Tensor | None
    bias: Tensor | None
    if isinstance(module, GgufLinear):
        return _gguf_projection(module, held)
    if type(module) is nn.Linear:
        weight, scale, bias = module.weight, None, module.bias
    elif isinstance(module, WeightOnlyInt8):
        weight, scale, bias = module.weight_int8, module.scale, module.bias
    else:
        return None
    tensors = [t for t in (weight, scale, bias) if t is not None]
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    if (weight.dtype, bias.dtype if bias is not None else torch.float32) not in (
        (torch.float32, torch.float32),
        (torch.int8, torch.float32),
    ):
        return None
    held.extend(tensors)
    return _Projection(
        weight.data_ptr(),
        scale.data_ptr() if scale is not None else None,
        bias.data_ptr() if bias is not None else None,
        weight.shape[0],
        weight.shape[1],
    )


def _gguf_projection(module: GgufLinear, held: list[Tensor]) -> _Projection | None:
    """The native view of a projection kept as GGUF blocks: its parts' types, blocks and rows."""
    parts = module.stored_parts()
    bias = module.bias
    if len(parts) > _MAX_GGUF_PARTS or (bias is not None and not bias.is_contiguous()):
        return None
    if module.input_order is not None:
        # The native stack hands each projection x as the layer made it; this one reads x reordered.
        return None
    projection = _Projection(
        None,
        None,
        bias.data_ptr() if bias is not None else None,
        module.out_features,
        module.in_features,
        len(parts),
    )
    for index, (qtype, blocks) in enumerate(parts):
        projection.gguf_types[index] = int(qtype)
        projection.gguf_blocks[index] = blocks.data_ptr()
        projection.gguf_rows[index] = blocks.shape[0]
        held.append(blocks)
    if bias is not None:
        held.append(bias)
    return projection


def _lora(projections: list[_Projection | None], lora: LoraLayer | None, held: list[Tensor]) -> bool:
    """Point each projection at its adapter slots (where the model serves adapters); False when the
    slots are not float32 CPU tensors, which the native stack cannot read."""
    if lora is None:
        return True
    for name, projection in zip(PROJECTIONS, projections, strict=True):
        a, bt = lora.weights[name]
        if a.dtype != torch.float32 or a.device.type != "cpu" or projection is None:
            return False
        bands = lora.bands[name]
        held.extend((a, bt, bands))
        projection.lora_a, projection.lora_bt, projection.lora_rank = a.data_ptr(), bt.data_ptr(), a.shape[1]
        projection.lora_bands, projection.lora_num_bands = bands.data_ptr(), bands.shape[0]
    return True


def _norm(module: nn.Module, held: list[Tensor]) -> int | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    if not weight.is_contiguous():
        return None
    held.append(weight)
    return weight.data_ptr()


class NativeDecodeStack:
    """The native views of one model's layers over one KV cache, and the tensors they point to."""

    def __init__(
        self, config: ModelConfig, layers: list[_Layer], final_norm: int, held: list[Tensor], kv_format: int
    ) -> None:
        self.config = config
        self.layers = (_Layer * len(layers))(*layers)
        self.final_norm = final_norm
        self.held = held
        self.kv_format = kv_format  # the cache rows' csrc/paged_attention.cpp id
        # The widest projection's adapter rows (q/k/v's three bands), 0 without adapter slots.
        self.lora_rank = max((layer.qkv.lora_rank for layer in layers), default=0)

    @classmethod
    def build(cls, model: CausalLM, cache: KVCache) -> NativeDecodeStack | None:
        """The views of `model` over `cache`, or None when some layer is not one the native stack runs."""
        kv_format = cache.format.native_id
        if kv_format is None or cache.device.type != "cpu" or not len(model.layers):
            return None
        if not all(t.is_contiguous() for t in (*cache.keys, *cache.values)):
            return None
        stack_layers = model.stack_layers()
        if stack_layers is None:
            return None
        held: list[Tensor] = [*cache.keys, *cache.values]
        final_norm = _norm(model.norm, held)
        layers: list[_Layer] = []
        for index, layer in enumerate(stack_layers):
            modules = (layer.qkv, layer.o, layer.gate_up, layer.down)
            projections = [_projection(module, held) for module in modules]
            norms = (_norm(layer.input_norm, held), _norm(layer.post_attention_norm, held))
            if (
                any(p is None for p in projections)
                or None in norms
                or not _lora(projections, layer.lora, held)
            ):
                return None
            keys, values = cache.layer(index)
            layers.append(_Layer(*norms, *projections, keys.data_ptr(), values.data_ptr()))
        if final_norm is None:
            return None
        return cls(model.config, layers, final_norm, held, kv_format)

    def run(
        self,
        kernels: native.Library,
        residual: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        lora: LoraRows | None,
    ) -> Tensor:
        """The final-normed hidden states [rows, hidden] of a decode-only step; `residual` is consumed.
        `lora`: the rows' adapter slots, or None when no row has one."""
        c = self.config
        rows = residual.shape[0]
        step = _Step(
            rows,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            c.rms_norm_eps,
            c.attention_scale,
            cos.data_ptr(),
            sin.data_ptr(),
            meta.block_tables.data_ptr(),
            meta.seq_lens.data_ptr(),
            meta.slot_mapping.data_ptr(),
            meta.block_tables.shape[1],
            meta.block_size,
            self.kv_format,
        )
        widths = c.q_size + 2 * c.kv_size + c.q_size + 3 * c.intermediate_size + 2 * c.hidden_size
        scratch = torch.empty(rows * widths, dtype=torch.float32)
        shrunk: Tensor | None = None
        if lora is not None:
            if not self.lora_rank:
                raise ValueError("a step with adapter rows on a model whose stack has no adapter slots")
            shrunk = torch.empty(rows * self.lora_rank, dtype=torch.float32)
            step.lora_rows, step.lora_scratch = lora.slots.data_ptr(), shrunk.data_ptr()
            step.lora_order, step.lora_count = lora.order.data_ptr(), lora.order.shape[0]
        hidden = torch.empty_like(residual)
        kernels.decode_stack(
            ctypes.addressof(self.layers),
            len(self.layers),
            ctypes.addressof(step),
            self.final_norm,
            residual.data_ptr(),
            hidden.data_ptr(),
            scratch.data_ptr(),
        )
        return hidden


def applies(meta: AttentionMetadata, residual: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether this step is one the native stack runs: decodes only, at most MAX_ROWS, float32 CPU."""
    return (
        _enabled
        and not meta.prefills
        and 0 < meta.num_decodes == meta.num_tokens <= MAX_ROWS
        and residual.device.type == "cpu"
        and residual.dtype == cos.dtype == sin.dtype == torch.float32
        and residual.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
        and meta.block_tables.is_contiguous()
        and meta.block_tables.dtype == torch.int64
        and meta.seq_lens.dtype == torch.int32
        and meta.slot_mapping.dtype == torch.int64
        and not torch.is_grad_enabled()
    )
