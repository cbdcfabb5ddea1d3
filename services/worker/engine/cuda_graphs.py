"""CUDA graphs for decode-only steps: capture once per (batch bucket, context bucket), then replay.

A decode step of a small model on a GPU is bound by kernel launches, not math; replaying a captured
graph removes the launch cost. Graphs need static shapes, so a step is padded up to the next batch
bucket and its context to the next power-of-two number of blocks; padding rows write their K/V into
one scratch block that no sequence owns. This module only runs the model; it must not choose what
runs (the scheduler does) nor sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from services.worker.model.attention import AttentionMetadata

if TYPE_CHECKING:
    from torch import Tensor

    from services.worker.model.kv_cache import KVCache
    from services.worker.model.llama import LlamaForCausalLM

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIN_CONTEXT_BLOCKS = 4


class _Graph:
    """One captured decode step and the static buffers it reads and writes."""

    def __init__(self, batch: int, blocks: int, block_size: int, device: torch.device) -> None:
        self.batch = batch
        self.blocks = blocks
        self.input_ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(batch, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(batch, blocks, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(batch, dtype=torch.int32, device=device)
        kv_len = blocks * block_size
        self.mask = torch.zeros(batch, 1, 1, kv_len, dtype=torch.bool, device=device)
        self.meta = AttentionMetadata(
            query_lens=[1] * batch,
            context_lens=[kv_len] * batch,
            num_decodes=batch,
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables,
            block_size=block_size,
            num_tokens=batch,
            decode_block_ids=self.block_tables.view(-1),
            decode_kv_len=kv_len,
            decode_mask=self.mask,
            prefills=(),
            last_token_indices=torch.arange(batch, device=device),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_lens=self.seq_lens,
        )
        self.graph = torch.cuda.CUDAGraph()
        self.hidden: Tensor | None = None


class CudaGraphRunner:
    """Replays decode steps of up to BATCH_BUCKETS[-1] sequences from captured graphs."""

    def __init__(
        self, model: LlamaForCausalLM, cache: KVCache, block_size: int, device: torch.device, pad_block: int
    ) -> None:
        self.model = model
        self.cache = cache
        self.block_size = block_size
        self.device = device
        self.pad_block = pad_block
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool: Any = None
        self.max_blocks = -(-model.config.max_position_embeddings // block_size)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run_decode(
        self,
        input_ids: list[int],
        positions: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
    ) -> Tensor | None:
        """Hidden states [B, hidden] of a decode-only step, or None when no bucket fits it."""
        batch = next((b for b in BATCH_BUCKETS if b >= len(input_ids)), None)
        blocks = _next_power_of_two(max(-(-c // self.block_size) for c in context_lens))
        if batch is None or blocks > _next_power_of_two(self.max_blocks):
            return None
        graph = self._graphs.get((batch, blocks)) or self._capture(batch, blocks)
        self._fill(graph, input_ids, positions, context_lens, block_tables)
        graph.graph.replay()
        assert graph.hidden is not None
        return graph.hidden[: len(input_ids)]

    def _fill(
        self,
        graph: _Graph,
        input_ids: list[int],
        positions: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
    ) -> None:
        real = len(input_ids)
        pad = graph.batch - real
        size = self.block_size
        pad_slot = self.pad_block * size
        slots = [table[p // size] * size + p % size for table, p in zip(block_tables, positions, strict=True)]
        tables = [
            table[: graph.blocks] + [self.pad_block] * (graph.blocks - len(table)) for table in block_tables
        ]
        tables += [[self.pad_block] * graph.blocks] * pad
        lens = [*context_lens, *([1] * pad)]
        # One host-to-device copy per buffer; padding rows attend to (and write) the scratch block only.
        graph.input_ids.copy_(torch.tensor([*input_ids, *([0] * pad)]), non_blocking=True)
        graph.positions.copy_(torch.tensor([*positions, *([0] * pad)]), non_blocking=True)
        graph.slot_mapping.copy_(torch.tensor([*slots, *([pad_slot] * pad)]), non_blocking=True)
        graph.block_tables.copy_(torch.tensor(tables), non_blocking=True)
        graph.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        kv_len = graph.blocks * size
        graph.mask.copy_((torch.arange(kv_len)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :])

    def _capture(self, batch: int, blocks: int) -> _Graph:
        graph = _Graph(batch, blocks, self.block_size, self.device)
        graph.block_tables.fill_(self.pad_block)
        graph.slot_mapping.fill_(self.pad_block * self.block_size)
        graph.mask[..., 0] = True
        # Warm up on a side stream so lazy initialisation (workspaces, autotuning) is not captured.
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                self.model(graph.input_ids, graph.positions, graph.meta, self.cache)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        with torch.inference_mode(), torch.cuda.graph(graph.graph, pool=self._pool):
            graph.hidden = self.model(graph.input_ids, graph.positions, graph.meta, self.cache)
        self._pool = graph.graph.pool()
        self._graphs[(batch, blocks)] = graph
        return graph


def _next_power_of_two(value: int) -> int:
    return max(MIN_CONTEXT_BLOCKS, 1 << max(0, value - 1).bit_length())
