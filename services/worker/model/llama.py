"""The Llama-family causal language model (Llama 2/3.x, SmolLM2, TinyLlama, Qwen2) over a paged cache.

This module owns the model's forward pass for one engine step: a flat list of tokens from many
sequences (decode tokens and prefill chunks together), their positions, and the attention metadata
that says where each reads and writes the KV cache. `forward` returns final-normed hidden states;
`compute_logits` projects only the rows the caller selects, since the vocabulary projection is the
largest single matmul of a decode step. A decode-only step of a few rows on the CPU runs all its
layers in one native call (decode_stack.py), with the same results as the layer-by-layer loop.
It must not read files (the loader does) nor sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from services.worker.model import decode_stack, native
from services.worker.model.attention import TorchAttention
from services.worker.model.layers import LlamaDecoderLayer, RMSNorm
from services.worker.model.rope import RotaryEmbedding
from services.worker.model.small_linear import linear, project

if TYPE_CHECKING:
    from services.worker.model.attention import AttentionBackend, AttentionMetadata
    from services.worker.model.config import ModelConfig
    from services.worker.model.kv_cache import KVCache


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm, and a (possibly tied) vocabulary projection."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        backend = attention if attention is not None else TorchAttention()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        layers = range(config.num_hidden_layers)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend) for _ in layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied checkpoints reuse the embedding matrix; no separate parameter exists to load.
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # (cache key, views of the layers for decode_stack or None where it cannot run), built at the
        # first step that could use them and rebuilt when the cache changes. The views hold the old
        # cache's tensors, so a new cache never reuses their addresses and the key cannot collide.
        self._native_stack: tuple[int, decode_stack.NativeDecodeStack | None] | None = None

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Swap the attention implementation of every layer (e.g. for a GPU paged kernel)."""
        for layer in self.layers:
            if isinstance(layer, LlamaDecoderLayer):
                layer.self_attn.backend = backend

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, cache: KVCache
    ) -> Tensor:
        """Run one step: input_ids and positions [T] -> final-normed hidden states [T, hidden].

        Writes every token's k/v into `cache` at `meta.slot_mapping` along the way.
        """
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both be [T]"
            )
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"{input_ids.shape[0]} input ids for a step of {meta.num_tokens} tokens")
        if cache.num_layers != len(self.layers):
            raise ValueError(f"the cache has {cache.num_layers} layers, the model {len(self.layers)}")
        residual = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, residual.dtype)
        kernels = native.library() if decode_stack.applies(meta, residual, cos, sin) else None
        stack = self._stack(cache) if kernels is not None else None
        if kernels is not None and stack is not None:
            return stack.run(kernels, residual, cos, sin, meta)
        delta: Tensor | None = None
        for index, layer in enumerate(self.layers):
            delta, residual = layer(delta, residual, cos, sin, meta, cache.layer(index))
        if delta is None:  # a model without layers
            only: Tensor = self.norm(residual)
            return only
        normed, _ = self.norm.add(delta, residual)
        return normed

    def _stack(self, cache: KVCache) -> decode_stack.NativeDecodeStack | None:
        """The native stack's views over `cache`, rebuilt when the cache changes; None if it cannot run."""
        key = cache.keys[0].data_ptr()
        if self._native_stack is None or self._native_stack[0] != key:
            self._native_stack = (key, decode_stack.NativeDecodeStack.build(self, self.config, cache))
        return self._native_stack[1]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Project selected hidden rows [N, hidden] to float32 logits [N, vocab]."""
        if self.lm_head is None:
            return linear(hidden, self.embed_tokens.weight).float()
        return project(self.lm_head, hidden).float()
