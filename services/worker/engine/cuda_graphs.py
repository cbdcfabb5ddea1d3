"""CUDA graphs for decode-only steps: captured at warm-up per (batch bucket, context bucket), then replayed.

A decode step of a small model on a GPU is bound by kernel launches, not math; replaying a captured
graph removes the launch cost. Graphs need static shapes, so a step is padded up to the next batch
bucket and its context to the next power-of-two number of blocks; padding rows write their K/V into
one scratch block that no sequence owns. `capture_all` captures every bucket the engine's settings can
reach (batches up to max_num_seqs, contexts up to max_model_len) while the worker warms up, before it
reports SERVING, largest first so the shared memory pool is sized once; an out-of-memory capture drops
that batch bucket and every larger one, and says so. A model with sliding-window layers is not
captured (`captures`): its window masks are built per step from the contexts, which a replay would
not redo. A step no captured graph fits runs eagerly:
nothing is captured inside a serving step, where a capture would stall every running request. This
module only runs the model; it must not choose what runs (the scheduler does) nor sample.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from services.worker.model.attention import AttentionMetadata

if TYPE_CHECKING:
    from torch import Tensor

    from services.worker.model.family import CausalLM
    from services.worker.model.kv_cache import KVCache

log = logging.getLogger(__name__)


def captures(model: CausalLM) -> bool:
    """Whether this model's decode steps can be replayed from graphs: no sliding-window layers, and a
    forward that only computes (a tensor-parallel model's sends its ranks their plan first)."""
    return not model.config.windows and model.replayable


BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIN_CONTEXT_BLOCKS = 4


@dataclass(frozen=True, slots=True)
class CaptureReport:
    """What the warm-up capture did: graphs, seconds, device memory, and the buckets it gave up."""

    graphs: int
    seconds: float
    memory_bytes: int
    largest_batch: int
    largest_blocks: int
    dropped_batches: tuple[int, ...] = field(default_factory=tuple)


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
        self, model: CausalLM, cache: KVCache, block_size: int, device: torch.device, pad_block: int
    ) -> None:
        self.model = model
        self.cache = cache
        self.block_size = block_size
        self.device = device
        self.pad_block = pad_block
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool: Any = None
        self.replays = 0  # decode steps served from a graph (tests and benchmarks read it)
        self.max_blocks = -(-model.config.max_position_embeddings // block_size)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def buckets(self, max_num_seqs: int, max_model_len: int) -> tuple[list[int], list[int]]:
        """The batch and context-block buckets a step of these settings can reach."""
        top_batch = next((b for b in BATCH_BUCKETS if b >= max_num_seqs), BATCH_BUCKETS[-1])
        batches = [b for b in BATCH_BUCKETS if b <= top_batch]
        top_blocks = _next_power_of_two(
            -(-min(max_model_len, self.max_blocks * self.block_size) // self.block_size)
        )
        blocks = [b for b in _powers_of_two(MIN_CONTEXT_BLOCKS) if b <= top_blocks]
        return batches, blocks

    def capture_all(self, max_num_seqs: int, max_model_len: int) -> CaptureReport:
        """Capture every reachable bucket now, largest first; an OOM drops that batch bucket and larger."""
        batches, blocks = self.buckets(max_num_seqs, max_model_len)
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        started = time.perf_counter()
        dropped: list[int] = []
        for batch in reversed(batches):
            try:
                for size in reversed(blocks):
                    if (batch, size) not in self._graphs:
                        self._capture(batch, size)
            except torch.OutOfMemoryError:
                dropped = [b for b in batches if b >= batch]
                for key in [k for k in self._graphs if k[0] >= batch]:
                    del self._graphs[key]
                torch.cuda.empty_cache()
                log.warning(
                    "CUDA graph capture ran out of memory at batch %d: batches %s run eagerly; lower "
                    "max_num_seqs or kv_cache_memory_bytes to capture them",
                    batch,
                    dropped,
                )
                continue
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        captured = [b for b in batches if b not in dropped]
        report = CaptureReport(
            graphs=len(self._graphs),
            seconds=time.perf_counter() - started,
            memory_bytes=max(0, free_before - free_after),
            largest_batch=max(captured, default=0),
            largest_blocks=max(blocks),
            dropped_batches=tuple(sorted(set(dropped))),
        )
        log.info(
            "captured %d CUDA graphs (batches up to %d, contexts up to %d blocks) in %.1f s, %.1f MiB",
            report.graphs,
            report.largest_batch,
            report.largest_blocks,
            report.seconds,
            report.memory_bytes / 2**20,
        )
        return report

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
        graph = self._graphs.get((batch, blocks))
        if graph is None:
            # Not captured at warm-up (dropped after an out-of-memory capture): eager, never a capture here.
            return None
        self._fill(graph, input_ids, positions, context_lens, block_tables)
        graph.graph.replay()
        self.replays += 1
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


def _powers_of_two(start: int) -> list[int]:
    return [start << shift for shift in range(32)]
