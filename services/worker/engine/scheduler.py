"""Continuous batching: which sequences run in the next engine step, and how many tokens each.

Owns the waiting and running queues, chunked prefill within the step's prefill budget and running limit
(step_limits.py sets both: what a step's decodes leave, an inter-token SLO's caps, load shedding's
limit), priorities (FCFS within one; yielding.py names the running sequences that give way to a more
urgent one of another tenant), preemption by recompute when KV blocks run out, load shedding after a
step that ran out of memory, and which decodes score drafted tokens (speculation.py proposes them; only
budget and free blocks left after every plain decode go to them). A waiting sequence whose prefix the
block manager has cached starts from those blocks: its KV need and its share of the prefill budget count
only the tokens it computes; one that names a LoRA adapter starts once the adapter table gives it a slot.
postprocess applies each step's sampled tokens through step_results.py
(outputs and finish decisions) and takes back the sequences that end. It must not import torch nor do
I/O: the runner executes batches, the engine loop owns the thread that calls schedule, postprocess,
abort and shed_load, one at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.engine.batch_builder import BatchBuilder, SchedulerStats
from services.worker.engine.block_manager import NO_HIT
from services.worker.engine.sequence import (
    FinishReason,
    ScheduledBatch,
    ScheduledEntry,
    Sequence,
    SequenceStatus,
    StepOutput,
)
from services.worker.engine.step_limits import StepLimits
from services.worker.engine.step_results import StopRule, apply_step
from services.worker.engine.waiting_queue import WaitingQueue
from services.worker.engine.yielding import yielding
from strata.sampling import InvalidRequestError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from collections.abc import Sequence as SequenceOf

    from services.worker.engine.adapters import AdapterTable
    from services.worker.engine.block_manager import BlockManager
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.sequence import TokenLogprobs

__all__ = ["ScheduledBatch", "ScheduledEntry", "Scheduler", "SchedulerStats", "StepOutput"]


def _urgency(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, seq.arrival)


class Scheduler:
    """Decides each step's batch over a paged KV cache and applies each step's sampled tokens."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        *,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        adapters: AdapterTable | None = None,
    ) -> None:
        """max_model_len: the context limit to enforce, already resolved by the caller; adapters: the
        engine's LoRA adapters, where it serves them."""
        if block_manager.block_size != config.block_size:
            raise ValueError(
                f"block manager block_size={block_manager.block_size} differs from the config's "
                f"{config.block_size}: build it with BlockManager(num_blocks, config.block_size)"
            )
        self.config = config
        self.block_manager = block_manager
        self.stop = StopRule(frozenset(eos_token_ids), max_model_len)
        self.limits = StepLimits(config, block_manager.block_size)
        self.adapters = adapters
        self._waiting = WaitingQueue()
        self._running: list[Sequence] = []  # in admission order: shed_load drops the newest
        self._requests: dict[str, Sequence] = {}
        self._num_steps = 0
        self._num_preemptions = 0
        self._last_kind_was_prefill = False
        self._prefix_query_blocks = 0
        self._prefix_hit_blocks = 0
        self._num_draft_tokens = 0
        self._num_accepted_tokens = 0
        self._num_speculative_decodes = 0

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise InvalidRequestError if a request of this size could never fit this engine's KV cache."""
        # The last sampled token is never fed back, so its K/V never needs a slot.
        max_cached = num_prompt_tokens + max_new_tokens - 1
        need = self.block_manager.blocks_needed(max_cached)
        if need > self.block_manager.num_blocks:
            raise InvalidRequestError(
                "max_new_tokens",
                max_new_tokens,
                f"the prompt's {num_prompt_tokens} tokens plus max_new_tokens need {need} KV blocks "
                f"of {self.block_manager.block_size} tokens; this worker's cache holds "
                f"{self.block_manager.num_blocks}",
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence that passed the engine's validation (LLMEngine.validate)."""
        if seq.request_id in self._requests:
            raise ValueError(f"request {seq.request_id!r} is already in the scheduler")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"{seq!r} is not a fresh waiting sequence")
        self._requests[seq.request_id] = seq
        self._waiting.push_new(seq)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORTED) -> bool:
        """Drop a request from either queue and free its blocks now; False if it is not here."""
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    @property
    def running(self) -> list[Sequence]:
        """A copy of the running sequences, in admission order."""
        return list(self._running)

    @property
    def waiting(self) -> list[Sequence]:
        """A copy of the waiting sequences, in the order they will be admitted."""
        return list(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        slo = self.limits.reported_slo(self.itl_slo_s)
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            free_kv_tokens=bm.free_tokens,
            total_kv_tokens=bm.num_blocks * bm.block_size,
            kv_cache_usage=bm.usage,
            num_steps=self._num_steps,
            num_preemptions=self._num_preemptions,
            num_load_sheds=self.limits.num_load_sheds,
            effective_max_num_seqs=self.limits.max_running(slo),
            prefill_budget=self.limits.prefill_budget(len(self._running), slo),
            num_cached_blocks=bm.num_cached_blocks,
            num_evictable_blocks=bm.num_evictable_blocks,
            num_evictions=bm.num_evictions,
            prefix_query_blocks=self._prefix_query_blocks,
            prefix_hit_blocks=self._prefix_hit_blocks,
            num_draft_tokens=self._num_draft_tokens,
            num_accepted_tokens=self._num_accepted_tokens,
            num_speculative_decodes=self._num_speculative_decodes,
        )

    @property
    def itl_slo_s(self) -> float | None:
        """The tightest inter-token SLO among the running sequences and the next to admit; None: none."""
        slos = [seq.itl_slo_s for seq in self._running if seq.itl_slo_s is not None]
        head = self._waiting.peek() if self._waiting else None
        if head is not None and head.itl_slo_s is not None:
            slos.append(head.itl_slo_s)
        return min(slos, default=None)

    @property
    def effective_max_num_seqs(self) -> int:
        """The running limit reported: load shedding's, and what the inter-token SLO leaves room for."""
        return self.limits.max_running(self.limits.reported_slo(self.itl_slo_s))

    def schedule(self, proposals: Mapping[str, list[int]] | None = None) -> ScheduledBatch:
        """Pick this step's work. Allocates the KV blocks it needs; may preempt running sequences.

        proposals: request id -> tokens drafted to follow its last one (speculation.py); a decoding
        sequence scores as many of them as the step's budget and the free blocks allow after every
        plain decode is placed, so that drafts never preempt nor displace anyone's work.
        """
        self._num_steps += 1
        plan = BatchBuilder(self._num_steps, self.config.max_num_batched_tokens)
        slo = self.itl_slo_s
        max_running = self.limits.max_running(slo)
        for victim in yielding(self._waiting, self._running, max_running, self.block_manager, plan.budget):
            self._preempt(victim)
        order = sorted(self._running, key=_urgency)
        if self.config.mixed_batches:
            self._schedule_decodes(plan, order)
            drafted = self._add_drafts(plan, proposals or {})
            plan.budget = min(plan.budget, self.limits.prefill_budget(plan.batch.num_decodes + drafted, slo))
            self._schedule_prefills(plan, order, max_running)
            return plan.batch
        # Alternate when both kinds of work exist, so neither prefills nor decodes starve.
        prefill_first = not self._last_kind_was_prefill
        for is_prefill in (prefill_first, not prefill_first):
            if is_prefill:
                # A prefill-only step delays every running stream's next token as much as a decode step.
                plan.budget = min(plan.budget, self.limits.prefill_budget(len(order), slo))
                self._schedule_prefills(plan, order, max_running)
            else:
                self._schedule_decodes(plan, order)
                self._add_drafts(plan, proposals or {})
            if plan.batch.entries:
                self._last_kind_was_prefill = is_prefill
                break
        return plan.batch

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled: SequenceOf[int],
        *,
        logprobs: SequenceOf[TokenLogprobs | None] | None = None,
        prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None,
    ) -> list[StepOutput]:
        """Apply a finished step: sampled holds one token id per sampled row, in order; logprobs
        (aligned with it) and prompt_logprobs (by entry index) what the runner computed."""
        outputs = apply_step(
            batch,
            sampled,
            block_manager=self.block_manager,
            stop=self.stop,
            finish=self._finish,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        for entry in batch.entries[: batch.num_decodes]:
            if entry.num_drafts and entry.seq.status is SequenceStatus.RUNNING:
                # Blocks that hold only rejected drafts' slots go back now: tables stay exact.
                self.block_manager.release_tail(entry.seq, entry.seq.num_computed_tokens)
        for out in outputs:
            if out.num_drafted:
                self._num_draft_tokens += out.num_drafted
                self._num_accepted_tokens += out.num_accepted
                self._num_speculative_decodes += 1
        self.limits.stepped()
        return outputs

    def shed_load(self) -> list[Sequence]:
        """After a step ran out of memory: preempt the newest half of the running sequences (keeping
        one) and lower the running limit; it regains one every shed_recovery_steps good steps.

        Drop the failed batch: its sequences were not advanced; the victims freed their blocks and
        the others keep theirs, so the next schedule() repeats their work without leaking any.
        """
        n = len(self._running)
        count = min(n - 1, (n + 1) // 2) if n else 0
        victims = self._running[n - count :]
        # Newest first, so the oldest victim ends up at the very front of the waiting queue.
        for victim in reversed(victims):
            self._preempt(victim)
        self.limits.shed(n - count)
        return victims

    @property
    def request_ids(self) -> set[str]:
        return set(self._requests)

    @property
    def adapters_used(self) -> list[str]:  # an adapter in use keeps its slot
        return [seq.adapter for seq in self._running if seq.adapter]

    def _schedule_decodes(self, plan: BatchBuilder, order: list[Sequence]) -> None:
        i = 0
        while i < len(order) and plan.budget > 0:
            seq = order[i]
            if seq.num_new_tokens_to_compute != 1:
                i += 1
                continue
            target = seq.num_computed_tokens + 1
            if self._make_room(plan, order, i, target) >= target:
                self.block_manager.allocate_for(seq, target)
                plan.add(seq, 1, decode=True)
                i += 1
            else:
                # Nothing less urgent is left to preempt: this sequence yields its own blocks.
                order.pop(i)
                self._preempt(seq)
                plan.batch.preempted.append(seq)

    def _add_drafts(self, plan: BatchBuilder, proposals: Mapping[str, list[int]]) -> int:
        """Let the step's decodes score their proposals, in urgency order, while budget and free
        blocks last; return how many draft tokens it took."""
        bm = self.block_manager
        taken = 0
        for index, entry in enumerate(plan.batch.entries[: plan.batch.num_decodes]):
            seq = entry.seq
            drafts = proposals.get(seq.request_id)
            if not drafts or plan.budget <= 0:
                continue
            room = min(len(drafts), plan.budget, bm.capacity_for(seq) - seq.num_computed_tokens - 1)
            if room <= 0:
                continue
            bm.allocate_for(seq, seq.num_computed_tokens + 1 + room)
            plan.speculate(index, drafts[:room])
            taken += room
        return taken

    def _schedule_prefills(self, plan: BatchBuilder, order: list[Sequence], max_running: int) -> None:
        bm = self.block_manager
        i = 0
        while i < len(order) and plan.budget > 0:
            seq = order[i]
            i += 1
            if seq.num_new_tokens_to_compute <= 1 or seq.request_id in plan.scheduled:
                continue
            start = seq.num_computed_tokens
            end = self._make_room(plan, order, i - 1, start + min(seq.num_new_tokens_to_compute, plan.budget))
            if end <= start:
                return  # not one block is free: it keeps its place, and nobody else can start
            bm.allocate_for(seq, end)
            plan.add(seq, end - start, decode=False)
        # Never admit in a step that preempted: the blocks just freed belong to running sequences.
        if plan.batch.preempted:
            return
        while self._waiting and plan.budget > 0 and len(self._running) < max_running:
            seq = self._waiting.peek()
            # Prompt positions whose logprobs are still wanted must be computed, not read from cache.
            hit = NO_HIT if seq.needs_prompt_logits else bm.cached_prefix(seq)
            cached = len(hit.blocks) * bm.block_size
            n = seq.num_new_tokens_to_compute - cached
            if n <= plan.budget:
                chunk = n
            elif self.config.chunked_prefill or n > self.config.max_num_batched_tokens:
                chunk = plan.budget  # without chunking, only what could never fit whole is split
            else:
                return
            if not bm.can_admit(seq, hit, cached + chunk):
                return  # strict FCFS: a smaller request behind it does not jump the queue
            if seq.adapter and self.adapters and not self.adapters.acquire(seq.adapter, self.adapters_used):
                return  # its adapter waits for a slot (or its weights): FCFS again
            self._waiting.pop()
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            seq.num_computed_tokens = bm.take_cached(seq, hit)
            if seq.num_preemptions == 0:
                self._count_first_admission(seq, len(hit.blocks))
            bm.allocate_for(seq, seq.num_computed_tokens + chunk)
            plan.add(seq, chunk, decode=False)

    def _count_first_admission(self, seq: Sequence, hit_blocks: int) -> None:
        """Usage's cached prompt tokens and the hit rate count a request's first admission only: a
        preempted sequence finding its own blocks again is not a client's prompt served from cache."""
        seq.num_cached_tokens = min(hit_blocks * self.block_manager.block_size, seq.num_prompt_tokens)
        cacheable = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
        self._prefix_query_blocks += cacheable
        self._prefix_hit_blocks += min(hit_blocks, cacheable)

    def _make_room(self, plan: BatchBuilder, order: list[Sequence], index: int, target: int) -> int:
        """Preempt running sequences less urgent than order[index] and not yet scheduled this step
        until it can cache target tokens; return how many tokens it can cache (maybe fewer)."""
        bm = self.block_manager
        seq = order[index]
        while not bm.can_grow(seq, target):
            victim_at = next(
                (j for j in range(len(order) - 1, index, -1) if order[j].request_id not in plan.scheduled),
                None,
            )
            if victim_at is None:
                break
            victim = order.pop(victim_at)
            self._preempt(victim)
            plan.batch.preempted.append(victim)
        return min(target, bm.capacity_for(seq))

    def _preempt(self, seq: Sequence) -> None:
        """Drop seq's cache and put it at the front of its priority; it recomputes when readmitted."""
        self._running.remove(seq)
        if self.block_manager.holds(seq):
            self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.push_preempted(seq, self._num_preemptions)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        if self.block_manager.holds(seq):
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._requests[seq.request_id]
