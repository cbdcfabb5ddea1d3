"""The step's plan on the wire from rank 0 to the other tensor-parallel ranks, and those ranks' loop.

Rank 0 runs the engine; every other rank only runs its shard of the forward pass. Before each forward
rank 0 broadcasts an op as small tensors (never pickled objects): a fixed int64 header, then for a
step one payload with the token ids, positions, query and context lengths and padded block tables,
from which a follower builds the same AttentionMetadata and runs the same forward (whose all-reduces
meet rank 0's). The other ops: logits (the hidden rows rank 0 projects, so that each rank projects
its share of the vocabulary: tensor_parallel.vocab_logits), a new KV cache (rank 0's runner made one,
so the followers make theirs with as many blocks), idle (a heartbeat, so a follower waiting for work
never hits the collective timeout and a dead rank is noticed while nothing runs), and stop.

This module owns that protocol. It must not decide what a step holds (the scheduler does) nor start
processes (ranks.py does).
"""

from __future__ import annotations

import logging
import time
from enum import IntEnum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from services.worker.model import kv_format
from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache
from services.worker.model.tensor_parallel import CollectiveClock, Shard, vocab_logits

if TYPE_CHECKING:
    from torch import Tensor

    from services.worker.model.family import CausalLM

log = logging.getLogger(__name__)

_HEADER = 6
"""[op, tokens, sequences, table width, decodes, block size]; a cache op: [op, blocks, block size, ...];
logits: [op, rows, ...]."""


class Op(IntEnum):
    STEP = 1
    CACHE = 2
    IDLE = 3
    STOP = 4
    LOGITS = 5


class Leader:
    """Rank 0's end of the link: one call per op, from the one thread that runs the forward passes."""

    def __init__(self, device: torch.device, clock: CollectiveClock, group: dist.ProcessGroup) -> None:
        """`group`: the ranks' step group (ranks.py), whose timeout bounds each op."""
        self.device = device
        self.clock = clock
        self.group = group
        self.last_sent = time.monotonic()

    def step(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> None:
        tables = meta.block_tables
        header = [Op.STEP, input_ids.shape[0], len(meta.query_lens), tables.shape[1], meta.num_decodes]
        lengths = torch.tensor(meta.query_lens + meta.context_lens, dtype=torch.int64, device=self.device)
        payload = torch.cat(
            (input_ids.to(torch.int64), positions.to(torch.int64), lengths, tables.reshape(-1))
        )
        self._send([*header, meta.block_size], payload)

    def logits(self, hidden: Tensor) -> None:
        self._send([Op.LOGITS, hidden.shape[0], 0, 0, 0, 0], hidden)

    def cache(self, cache: KVCache) -> None:
        self._send([Op.CACHE, cache.num_blocks, cache.block_size, 0, 0, 0])

    def idle(self) -> None:
        self._send([Op.IDLE, 0, 0, 0, 0, 0])

    def stop(self) -> None:
        self._send([Op.STOP, 0, 0, 0, 0, 0])

    def _send(self, header: list[int], payload: Tensor | None = None) -> None:
        started = time.perf_counter()
        dist.broadcast(torch.tensor(header, dtype=torch.int64, device=self.device), src=0, group=self.group)
        if payload is not None:
            dist.broadcast(payload.contiguous(), src=0, group=self.group)
        self.clock.add(started)
        self.last_sent = time.monotonic()


def follow(
    model: CausalLM, kv_cache_dtype: str, device: torch.device, shard: Shard, group: dist.ProcessGroup
) -> None:
    """A follower's loop: run rank 0's ops on this rank's shard until it says stop (or a collective
    fails, which raises: the process then exits and its group is restarted as one)."""
    clock = CollectiveClock()
    fmt = kv_format.resolve(kv_cache_dtype, model.dtype, device)
    cache: KVCache | None = None
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    with torch.inference_mode():
        while True:
            dist.broadcast(header, src=0, group=group)
            op, a, b, c, d, e = header.tolist()
            if op == Op.STOP:
                log.info("rank %d: rank 0 said stop", dist.get_rank())
                return
            if op == Op.IDLE:
                continue
            if op == Op.LOGITS:
                hidden = torch.empty(a, model.config.hidden_size, dtype=model.dtype, device=device)
                dist.broadcast(hidden, src=0, group=group)
                vocab_logits(model, hidden, shard, clock, group)
                continue
            if op == Op.CACHE:
                cache = None  # the old cache's memory goes back before the new one is taken
                cache = KVCache.allocate(model.config, a, b, fmt, device)
                continue
            if op != Op.STEP or cache is None:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: op {op} before a cache, or unknown: restart the group"
                )
            _step(model, cache, device, group, tokens=a, sequences=b, width=c, decodes=d, block_size=e)


def _step(
    model: CausalLM,
    cache: KVCache,
    device: torch.device,
    group: dist.ProcessGroup,
    *,
    tokens: int,
    sequences: int,
    width: int,
    decodes: int,
    block_size: int,
) -> None:
    payload = torch.empty(2 * tokens + 2 * sequences + sequences * width, dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0, group=group)
    input_ids, positions = payload[:tokens], payload[tokens : 2 * tokens]
    lengths = payload[2 * tokens : 2 * tokens + 2 * sequences].tolist()
    tables = payload[2 * tokens + 2 * sequences :].view(sequences, width).tolist()
    meta = AttentionMetadata.build(
        query_lens=lengths[:sequences],
        context_lens=lengths[sequences:],
        block_tables=tables,
        block_size=block_size,
        device=device,
        num_decodes=decodes,
    )
    model(input_ids, positions, meta, cache)
