"""The model interface: what every causal LM offers the engine, and what every family module declares.

`CausalLM` is the one interface the loader, the model runner, CUDA graphs, the native decode stack
and the int8 variants see: embeddings (`embed_tokens`), decoder `layers`, final `norm`, an optional
untied `lm_head`, a step's `forward` over the paged cache and `compute_logits`, the KV layout it needs
(its `config`: layers, KV heads, head dim, sliding windows) and which native paths it supports
(`native_paths`, and `stack_layers` for the native decode stack). The projections inside a layer are
named `qkv_proj`, `o_proj`, `gate_up_proj` and `down_proj` in every family, which is what the int8
variants and bitsandbytes replace by name.

`Family` is what one family's module declares to the registry: the architectures it reads, how its
config.json becomes a ModelConfig, the checkpoint tensors it needs and how they become the model's
state dict. This module owns those two contracts; it must not import any family, the registry, or
the decode stack (they import it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import Tensor

    from services.worker.model.attention import AttentionMetadata
    from services.worker.model.config import ModelConfig
    from services.worker.model.kv_cache import KVCache
    from services.worker.model.lora import LoraLayer, LoraSlots


@dataclass(frozen=True, slots=True)
class StackLayer:
    """One decoder layer as the native decode stack runs it: Llama's shape, module by module."""

    input_norm: nn.Module
    post_attention_norm: nn.Module
    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module
    lora: LoraLayer | None = None
    """The layer's adapter slots, where the model serves adapters."""


@dataclass(frozen=True, slots=True)
class NativePaths:
    """Which native CPU paths a model can take: the per-operator kernels always (where the kernels
    load), the whole-stack decode only when `decode_stack` is true; `reason` says why not."""

    decode_stack: bool
    reason: str = ""

    def describe(self) -> str:
        if self.decode_stack:
            return "native decode stack and kernels"
        return f"kernels per operator; no native decode stack ({self.reason})"


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over the paged KV cache (see the module docstring)."""

    config: ModelConfig
    embed_tokens: nn.Module
    """nn.Embedding, or an embedding that reads quantized rows (gguf_linear.GgufEmbedding)."""
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module | None

    @abstractmethod
    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, cache: KVCache
    ) -> Tensor:
        """input_ids and positions [T] -> final-normed hidden states [T, hidden]; writes k/v to `cache`."""

    @abstractmethod
    def compute_logits(self, hidden: Tensor, vocab: slice | None = None) -> Tensor:
        """Project selected hidden rows [N, hidden] to float32 logits [N, vocab]; with `vocab`, only
        those vocabulary entries (a tensor-parallel rank's share)."""

    @property
    @abstractmethod
    def native_paths(self) -> NativePaths:
        """Which native CPU paths this model's layers can take."""

    @abstractmethod
    def stack_layers(self) -> list[StackLayer] | None:
        """The layers as the native decode stack runs them, or None when it cannot run them now."""

    @property
    def replayable(self) -> bool:
        """Whether a CUDA graph may replay this model's forward: not where the forward does more than
        compute (a tensor-parallel model's sends the other ranks their plan first)."""
        return True

    def attach_lora(self, slots: LoraSlots) -> None:
        """Serve LoRA adapters from `slots`: every projection adds the deltas of the rows that name one.
        A model that cannot says why (a ValueError naming what would make it able to)."""
        raise ValueError(f"{type(self).__name__} cannot serve LoRA adapters")

    def idle(self) -> None:
        """Called on the step thread between steps while there is no work (a model spread over ranks
        keeps their link alive); nothing to do for a model in one process."""

    def close(self) -> None:
        """Release what the model holds outside its tensors (other ranks' processes); nothing here."""

    @property
    def dtype(self) -> torch.dtype:
        # The final norm's weight: always a dense tensor of the model's dtype, whatever the embeddings.
        return next(self.norm.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.norm.parameters()).device


@dataclass(frozen=True, slots=True)
class Family:
    """One model family as its module declares it to the registry."""

    name: str
    architectures: tuple[str, ...]
    """config.json `architectures` values this family loads."""
    model_types: tuple[str, ...]
    """config.json `model_type` values, for configs that name no architecture."""
    config: Callable[[dict[str, Any]], ModelConfig]
    """config.json (parsed) -> ModelConfig, raising ModelLoadError for what the family cannot run."""
    build: Callable[[ModelConfig], CausalLM]
    """An empty model of this config (the loader builds it on the meta device, then assigns weights)."""
    checkpoint_names: Callable[[ModelConfig], list[str]]
    """Every tensor name the checkpoint must hold."""
    state_dict: Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]
    """The checkpoint's tensors -> the model's state dict (renamed, fused, transformed)."""
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    """Tensors some exporters save that the family derives itself: skipped, not required."""
