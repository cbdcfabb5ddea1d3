"""The paged KV cache's device memory: per layer one key and one value tensor cut into fixed blocks.

This module owns the tensors and their size arithmetic, so the engine can size `num_blocks` from a
memory budget before allocating. Each layer's tensors have shape
[num_blocks, block_size, num_kv_heads, row_width], a row being one token's one KV head in the cache's
format (kv_format.py: head_dim values, and for int8 their scale's 4 bytes); a token lives at slot
block_id * block_size + offset. It must not decide which blocks belong to which sequence (the
engine's block manager does) nor read or write them (the attention backend does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from services.worker.model.kv_format import KVFormat, plain

if TYPE_CHECKING:
    from services.worker.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVCache:
    """Key and value block tensors of every layer."""

    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    format: KVFormat

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | KVFormat,
        device: str | torch.device,
    ) -> KVCache:
        """Allocate zeroed blocks for every layer (zeros: padding a backend reads is finite, and an
        int8 row of zeros has scale 0). A dtype means rows stored as computed, in that dtype."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must both be positive")
        fmt = dtype if isinstance(dtype, KVFormat) else plain(dtype)
        shape = (num_blocks, block_size, config.num_key_value_heads, fmt.row_width(config.head_dim))
        layers = range(config.num_hidden_layers)
        keys = tuple(torch.zeros(shape, dtype=fmt.storage, device=device) for _ in layers)
        values = tuple(torch.zeros(shape, dtype=fmt.storage, device=device) for _ in layers)
        return cls(keys=keys, values=values, format=fmt)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype | KVFormat) -> int:
        """Bytes one block costs across all layers, keys and values together (int8 scales included)."""
        fmt = dtype if isinstance(dtype, KVFormat) else plain(dtype)
        per_layer = 2 * block_size * config.num_key_value_heads * fmt.row_bytes(config.head_dim)
        return per_layer * config.num_hidden_layers

    @property
    def num_blocks(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def block_size(self) -> int:
        return int(self.keys[0].shape[1])

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        """The (key, value) block tensors of one layer."""
        return self.keys[index], self.values[index]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
