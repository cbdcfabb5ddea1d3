"""The decoder every family builds: embeddings, decoder layers, final norm, logits, over a paged cache.

This module owns the model's forward pass for one engine step: a flat list of tokens from many
sequences (decode tokens and prefill chunks together), their positions, and the attention metadata
that says where each reads and writes the KV cache. `forward` returns final-normed hidden states;
`compute_logits` projects only the rows the caller selects, since the vocabulary projection is the
largest single matmul of a decode step. The cos/sin of each distinct RoPE (Gemma 3's local layers
have their own) are computed once per step. A decode-only step of a few rows on the CPU runs all its
layers in one native call (decode_stack.py) when the layers have Llama's shape, with the same results
as the layer-by-layer loop. It must not read files (the loader does), know a checkpoint's names (the
family modules do), nor sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from services.worker.model import decode_stack, native
from services.worker.model.attention import TorchAttention
from services.worker.model.family import CausalLM, NativePaths, StackLayer
from services.worker.model.layers import DecoderLayer, RMSNorm
from services.worker.model.rope import RotaryEmbedding
from services.worker.model.small_linear import linear, project

if TYPE_CHECKING:
    from services.worker.model.attention import AttentionBackend, AttentionMetadata
    from services.worker.model.config import ModelConfig
    from services.worker.model.kv_cache import KVCache
    from services.worker.model.lora import LoraSlots


class DecoderLM(CausalLM):
    """Embeddings, decoder layers, final norm, and a (possibly tied) vocabulary projection."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        backend = attention if attention is not None else TorchAttention()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.rope, config.rotated_dims)
        # Gemma 3's sliding-window layers rotate with their own RoPE; None where all layers share one.
        self.sliding_rotary_emb: RotaryEmbedding | None = None
        if config.sliding_rope is not None:
            self.sliding_rotary_emb = RotaryEmbedding(config.sliding_rope, config.rotated_dims)
        layers = range(config.num_hidden_layers)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, index) for index in layers)
        self.norm: RMSNorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied checkpoints reuse the embedding matrix; no separate parameter exists to load.
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._paths = _native_paths(config)
        # (cache key, views of the layers for decode_stack or None where it cannot run), built at the
        # first step that could use them and rebuilt when the cache changes. The views hold the old
        # cache's tensors, so a new cache never reuses their addresses and the key cannot collide.
        self._native_stack: tuple[int, decode_stack.NativeDecodeStack | None] | None = None
        self.lora: LoraSlots | None = None

    @property
    def native_paths(self) -> NativePaths:
        return self._paths

    def stack_layers(self) -> list[StackLayer] | None:
        if not self._paths.decode_stack:
            return None
        views: list[StackLayer] = []
        for layer in self.layers:
            if not isinstance(layer, DecoderLayer) or type(layer.self_attn.backend) is not TorchAttention:
                return None
            attention, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            lora = self.lora.layers[len(views)] if self.lora is not None else None
            views.append(StackLayer(*norms, *projections, lora=lora))
        return views

    def attach_lora(self, slots: LoraSlots) -> None:
        if self.config.tensor_parallel_size > 1:
            raise ValueError(
                "LoRA adapters over tensor-parallel ranks are not served: set tensor_parallel_size 1"
            )
        for layer, lora in zip(self.layers, slots.layers, strict=True):
            if not isinstance(layer, DecoderLayer):
                raise ValueError(f"{type(layer).__name__} layers cannot serve LoRA adapters")
            layer.self_attn.lora = lora
            layer.mlp.lora = lora
        self.lora = slots
        self._native_stack = None  # its views are rebuilt with the slots' addresses

    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, cache: KVCache
    ) -> Tensor:
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both be [T]"
            )
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"{input_ids.shape[0]} input ids for a step of {meta.num_tokens} tokens")
        if cache.num_layers != len(self.layers):
            raise ValueError(f"the cache has {cache.num_layers} layers, the model {len(self.layers)}")
        residual = self.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:
            residual = residual * self.config.embedding_scale
        cos, sin = self.rotary_emb(positions, residual.dtype)
        if self._stack_applies(meta, residual, cos, sin):
            kernels = native.library()
            stack = self._stack(cache) if kernels is not None else None
            if kernels is not None and stack is not None:
                return stack.run(kernels, residual, cos, sin, meta, self.lora.rows if self.lora else None)
        sliding = self.sliding_rotary_emb(positions, residual.dtype) if self.sliding_rotary_emb else None
        delta: Tensor | None = None
        for index, layer in enumerate(self.layers):
            angles = sliding if sliding is not None and self.config.window(index) is not None else (cos, sin)
            delta, residual = layer(delta, residual, *angles, meta, cache.layer(index))
        if delta is None:  # a model without layers
            only: Tensor = self.norm(residual)
            return only
        normed, _ = self.norm.add(delta, residual)
        return normed

    def _stack_applies(self, meta: AttentionMetadata, residual: Tensor, cos: Tensor, sin: Tensor) -> bool:
        if not self._paths.decode_stack or not decode_stack.applies(meta, residual, cos, sin):
            return False
        # The stack attends to the whole context: exact only while no decode's context passes a window.
        windows = self.config.windows
        return not windows or max(meta.context_lens) <= windows[0]

    def _stack(self, cache: KVCache) -> decode_stack.NativeDecodeStack | None:
        """The native stack's views over `cache`, rebuilt when the cache changes; None if it cannot run."""
        key = cache.keys[0].data_ptr()
        if self._native_stack is None or self._native_stack[0] != key:
            self._native_stack = (key, decode_stack.NativeDecodeStack.build(self, cache))
        return self._native_stack[1]

    def compute_logits(self, hidden: Tensor, vocab: slice | None = None) -> Tensor:
        if self.lm_head is None:
            if not isinstance(self.embed_tokens, nn.Embedding):
                raise TypeError("a tied model with quantized embeddings projects through its lm_head")
            weight = self.embed_tokens.weight
            logits = linear(hidden, weight if vocab is None else weight[vocab]).float()
        elif vocab is None:
            logits = project(self.lm_head, hidden).float()
        elif isinstance(self.lm_head, nn.Linear):
            logits = linear(hidden, self.lm_head.weight[vocab]).float()
        else:
            raise TypeError("a quantized vocabulary projection projects whole rows only")
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap is not None else logits


def _native_paths(config: ModelConfig) -> NativePaths:
    """Whether the native decode stack (Llama's layer: RMSNorms, SwiGLU, whole-head RoPE, plain
    attention) can run this config's layers, and if not, the first reason why."""
    reasons = (
        (config.qk_norm, "q/k norms"),
        (config.sandwich_norms, "norms on each block's output"),
        (config.activation != "silu", f"{config.activation} activation"),
        (config.rotated_dims != config.head_dim, "partial RoPE"),
        (config.sliding_rope is not None, "a second RoPE for sliding-window layers"),
        # The stack runs every layer in one call: no all-reduce could meet the other ranks between them.
        (config.tensor_parallel_size > 1, "tensor parallel"),
    )
    reason = next((why for applies, why in reasons if applies), None)
    return NativePaths(decode_stack=reason is None, reason=reason or "")
