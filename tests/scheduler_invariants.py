"""What must hold between any two engine steps, checked by the engine and scheduler tests after each."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.engine.sequence import SequenceStatus

if TYPE_CHECKING:
    from services.worker.engine.scheduler import Scheduler


def check_invariants(sched: Scheduler) -> None:
    """Raise unless the scheduler's queues, statuses and block accounting agree."""
    waiting, running = sched.waiting, sched.running
    if any(s.status is not SequenceStatus.WAITING or s.block_table for s in waiting):
        raise AssertionError("a waiting sequence is not WAITING or holds blocks")
    if any(s.status is not SequenceStatus.RUNNING for s in running):
        raise AssertionError("a running sequence is not RUNNING")
    ids = [s.request_id for s in waiting + running]
    if len(set(ids)) != len(ids) or set(ids) != sched.request_ids:
        raise AssertionError("the queues and the request index disagree")
    block_size = sched.block_manager.block_size
    if any(s.num_computed_tokens > len(s.block_table) * block_size for s in running):
        raise AssertionError("a sequence has more computed tokens than its blocks hold")
    sched.block_manager.check_invariants(running)
