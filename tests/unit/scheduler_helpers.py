"""The scheduler tests' fake model and factories, shared by the scheduler and block manager tests.

FakeModel writes each step's token ids into a cache addressed through the sequences' block tables and
"samples" a hash of the cached context read back the same way. A wrong start, a lost or repeated
token, or two sequences sharing a block change the outputs. No torch, like the code under test.
"""

from __future__ import annotations

import zlib
from array import array
from typing import Any

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.config import EngineConfig
from services.worker.engine.scheduler import ScheduledBatch, Scheduler
from services.worker.engine.sequence import Sequence, StepOutput
from strata.sampling import SamplingParams
from tests.scheduler_invariants import check_invariants

EOS = 2
VOCAB_START = 10  # sampled ids stay clear of EOS and of the stop ids tests pick


class FakeModel:
    """A paged "KV cache" of token ids and a next token that hashes the whole cached context."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.cache: list[list[int]] = [[-1] * block_size for _ in range(num_blocks)]

    def run(self, batch: ScheduledBatch) -> list[int]:
        bs = self.block_size
        # All writes before any read, as attention does: a block shared by mistake shows up.
        for e in batch.entries:
            assert len(e.token_ids) == e.num_tokens
            for k, token in enumerate(e.token_ids):
                pos = e.start + k
                self.cache[e.seq.block_table[pos // bs]][pos % bs] = token
        sampled = []
        for e in batch.entries:
            # One row per sampled position: a speculative decode's row i sees its context up to its
            # last token and its first i drafts.
            for row in range(e.num_sampled_rows):
                end = e.start + e.num_tokens - e.num_drafts + row
                table = e.seq.block_table
                ctx = array("q", (self.cache[table[p // bs]][p % bs] for p in range(end)))
                sampled.append(VOCAB_START + zlib.crc32(ctx.tobytes()) % 5000)
        return sampled


def make_scheduler(num_blocks: int = 256, max_model_len: int = 4096, **config: object) -> Scheduler:
    engine_config = EngineConfig.model_validate(config)
    block_manager = BlockManager(
        num_blocks, engine_config.block_size, enable_prefix_caching=engine_config.enable_prefix_caching
    )
    return Scheduler(engine_config, block_manager, max_model_len=max_model_len, eos_token_ids=[EOS])


def make_seq(
    rid: str, prompt_len: int, max_new: int = 8, *, priority: int = 0, arrival: int = 0, **params: Any
) -> Sequence:
    prompt = [VOCAB_START + (zlib.crc32(f"{rid}:{i}".encode()) % 5000) for i in range(prompt_len)]
    return Sequence(
        rid, prompt, SamplingParams(max_new_tokens=max_new, **params), priority=priority, arrival=arrival
    )


def step(
    sched: Scheduler, model: FakeModel, proposals: dict[str, list[int]] | None = None
) -> tuple[ScheduledBatch, list[StepOutput]]:
    had_work = sched.has_work
    batch = sched.schedule(proposals)
    assert batch.is_empty != had_work, "a scheduler with work must always make progress"
    assert all(e.num_tokens >= 1 for e in batch.entries)
    outputs = sched.postprocess(batch, model.run(batch))
    check_invariants(sched)
    return batch, outputs


def run_all(sched: Scheduler, seqs: list[Sequence], max_steps: int = 100_000) -> dict[str, list[int]]:
    """Add every sequence, step until idle; return each request's streamed tokens."""
    model = FakeModel(sched.block_manager.num_blocks, sched.block_manager.block_size)
    for seq in seqs:
        sched.add(seq)
    streamed: dict[str, list[int]] = {seq.request_id: [] for seq in seqs}
    for _ in range(max_steps):
        if not sched.has_work:
            break
        batch, outputs = step(sched, model)
        assert batch.num_batched_tokens <= sched.config.max_num_batched_tokens
        for out in outputs:
            streamed[out.request_id].extend(out.new_token_ids)
    assert not sched.has_work
    for seq in seqs:
        assert seq.output_ids == streamed[seq.request_id]
    return streamed
