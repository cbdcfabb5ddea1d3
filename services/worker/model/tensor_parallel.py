"""Splitting a decoder over tensor-parallel ranks: one rank's config, its slice of every weight, the
all-reduce after the projections whose products are partial sums, and the vocabulary's gather.

Megatron's layout. q/k/v and gate/up are split by output rows (column parallel): each rank computes
its own query heads, the KV heads they read, and its slice of the MLP, with nothing to exchange. o and
down are split by input columns (row parallel): each rank's product is a partial sum of the full
result, and one all_reduce per block adds them up, so two collectives per layer. Embeddings and norms
stay whole on every rank. The vocabulary projection is split by vocabulary entries: each rank
projects its share for the rows rank 0 sends and one all_gather joins them
(docs/tensor-parallelism.md has the measurement that chose this over rank 0 projecting alone).
KV heads are shared out as evenly as they go, each with the query heads that read it (SmolLM2's 3 KV
heads and 9 query heads over 2 ranks: 2 and 6 on rank 0, 1 and 3 on rank 1; the MLP likewise need not
divide); a model with fewer KV heads than ranks gives each rank the one head its query heads read, so
those heads are stored on several ranks. A bias of a row-parallel projection is added once, by rank 0.

This module owns those arithmetic facts and the time spent in the collectives. It must not start
processes, read files or move a step's plan between ranks (ranks.py and rank_link.py do).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from services.worker.model.config import ModelConfig, ModelLoadError
from services.worker.model.layers import DecoderLayer
from services.worker.model.small_linear import project

if TYPE_CHECKING:
    from services.worker.model.family import CausalLM

_PROJECTION = re.compile(
    r"^layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))\.(weight|bias)$"
)


@dataclass(frozen=True, slots=True)
class Shard:
    """Which slice of the model one process holds: rank `rank` of `size`."""

    rank: int
    size: int


@dataclass(slots=True)
class CollectiveClock:
    """Seconds this rank spent in collectives (waiting for the slowest rank included) and how many."""

    seconds: float = 0.0
    calls: int = 0

    def add(self, started: float) -> None:
        self.seconds += time.perf_counter() - started
        self.calls += 1


def shard_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """Rank `shard.rank`'s config of a model split over `shard.size` ranks; ModelLoadError where it
    cannot split."""
    heads, kv_heads, size = config.num_attention_heads, config.num_key_value_heads, shard.size
    if kv_heads < size and (size % kv_heads or heads % size):
        raise ModelLoadError(
            f"{config.architecture} cannot be split over {size} ranks: with {kv_heads} KV heads, fewer than "
            f"the ranks, the ranks must be a multiple of them and divide the {heads} query heads; choose "
            f"a tensor_parallel_size of at most {kv_heads}, or one that divides the model's head counts"
        )
    q_rows, kv_rows = _q_heads(config, shard), _kv_heads(config, shard)
    mlp = _share(config.intermediate_size, shard)
    return replace(
        config,
        num_attention_heads=(q_rows.stop - q_rows.start) // config.head_dim,
        num_key_value_heads=(kv_rows.stop - kv_rows.start) // config.head_dim,
        intermediate_size=mlp.stop - mlp.start,
        tensor_parallel_size=size,
    )


def split_weights(weights: dict[str, Tensor], config: ModelConfig, shard: Shard) -> dict[str, Tensor]:
    """The full model's state dict (`config` is the whole model's) -> rank `shard.rank`'s."""
    out: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        match = _PROJECTION.match(name)
        if match is None:
            out[name] = tensor
            continue
        projection, kind = match.group(2) or match.group(3), match.group(4)
        if projection == "qkv_proj":
            out[name] = _qkv_rows(tensor, config, shard)
        elif projection == "gate_up_proj":
            out[name] = _gate_up_rows(tensor, config, shard)
        elif kind == "bias":
            # A partial sum's bias is added by one rank only, or the all-reduce would add it N times.
            out[name] = tensor if shard.rank == 0 else torch.zeros_like(tensor)
        elif projection == "o_proj":
            out[name] = tensor[:, _q_heads(config, shard)].contiguous()
        else:
            out[name] = tensor[:, _share(config.intermediate_size, shard)].contiguous()
    return out


def reduce_rows(model: CausalLM, clock: CollectiveClock, group: dist.ProcessGroup) -> None:
    """Make every layer's o and down projection add up the ranks' partial sums in `group` (after
    loading: the state dict's names are the plain projections')."""
    for layer in model.layers:
        if not isinstance(layer, DecoderLayer):
            raise ModelLoadError(
                f"{type(layer).__name__} is not the shared decoder layer: it cannot be split"
            )
        attention, mlp = layer.self_attn, layer.mlp
        # setattr: the layer declares plain projections; a RowParallelLinear stands in for one.
        setattr(attention, "o_proj", RowParallelLinear(attention.o_proj, clock, group))  # noqa: B010
        setattr(mlp, "down_proj", RowParallelLinear(mlp.down_proj, clock, group))  # noqa: B010


class RowParallelLinear(nn.Module):
    """A projection over this rank's input columns, summed over the ranks by one all_reduce."""

    def __init__(self, inner: nn.Module, clock: CollectiveClock, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.inner = inner
        self.clock = clock
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        partial = project(self.inner, x)
        started = time.perf_counter()
        dist.all_reduce(partial, group=self.group)
        self.clock.add(started)
        return partial


def vocab_logits(
    model: CausalLM, hidden: Tensor, shard: Shard, clock: CollectiveClock, group: dist.ProcessGroup
) -> Tensor:
    """Float32 logits [rows, vocab] of hidden rows every rank holds: each rank projects its share of
    the vocabulary and one all_gather joins them (shares padded to the widest, as all_gather needs)."""
    vocab = model.config.vocab_size
    shares = [_share(vocab, Shard(rank, shard.size)) for rank in range(shard.size)]
    part = model.compute_logits(hidden, shares[shard.rank])
    width = shares[0].stop - shares[0].start
    padded = torch.nn.functional.pad(part, (0, width - part.shape[1])).contiguous()
    parts = [torch.empty_like(padded) for _ in shares]
    started = time.perf_counter()
    dist.all_gather(parts, padded, group=group)
    clock.add(started)
    return torch.cat([p[:, : s.stop - s.start] for p, s in zip(parts, shares, strict=True)], dim=1)


def _share(total: int, shard: Shard) -> slice:
    """Rank r's contiguous share of `total` items: as even as it goes, the lower ranks one more, so
    rank 0 (whose memory budget sizes the cache every rank allocates) holds the largest."""
    share, extra = divmod(total, shard.size)
    start = shard.rank * share + min(shard.rank, extra)
    return slice(start, start + share + (shard.rank < extra))


def _head_rows(heads: slice, config: ModelConfig) -> slice:
    return slice(heads.start * config.head_dim, heads.stop * config.head_dim)


def _q_heads(config: ModelConfig, shard: Shard) -> slice:
    """This rank's query heads: those that read its KV heads (whole groups), or with fewer KV heads
    than ranks an even share."""
    kv = config.num_key_value_heads
    if kv < shard.size:
        return _head_rows(_share(config.num_attention_heads, shard), config)
    group = config.num_attention_heads // kv
    own = _share(kv, shard)
    return _head_rows(slice(own.start * group, own.stop * group), config)


def _kv_heads(config: ModelConfig, shard: Shard) -> slice:
    kv = config.num_key_value_heads
    if kv >= shard.size:
        return _head_rows(_share(kv, shard), config)
    # Fewer KV heads than ranks: the one head this rank's query heads read, kept by several ranks.
    head = shard.rank // (shard.size // kv)
    return _head_rows(slice(head, head + 1), config)


def _qkv_rows(tensor: Tensor, config: ModelConfig, shard: Shard) -> Tensor:
    q, kv = config.q_size, config.kv_size
    query, keys, values = tensor[:q], tensor[q : q + kv], tensor[q + kv :]
    own_kv = _kv_heads(config, shard)
    return torch.cat((query[_q_heads(config, shard)], keys[own_kv], values[own_kv])).contiguous()


def _gate_up_rows(tensor: Tensor, config: ModelConfig, shard: Shard) -> Tensor:
    half = config.intermediate_size
    own = _share(half, shard)
    return torch.cat((tensor[:half][own], tensor[half:][own])).contiguous()
