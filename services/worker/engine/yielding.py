"""Which running sequences give their slots to more urgent waiting ones when the running limit is reached.

A sequence's urgency is its priority (lower runs first: the gateway sends a tenant below its fair share
one step up, and interactive above batch), then its arrival. Without this a waiting sequence, however
urgent, waits for a running one to finish: one tenant whose long streams fill every running slot would
hold a quiet tenant's first token for as long as those streams take. So each waiting sequence beyond the
free slots that is strictly more urgent than some running sequence takes the slot of the least urgent
one (the youngest of the lowest priority): that sequence is preempted by recompute, and the blocks its
prompt and output filled stay in the prefix cache, so it resumes from them when a slot frees. Equal
priorities never preempt each other, so one tenant's requests never churn among themselves.

This module only chooses: the scheduler preempts the sequences it names. It must not touch queues or
blocks, nor import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from services.worker.engine.sequence import Sequence


def yielding(waiting: Iterable[Sequence], running: Iterable[Sequence], max_running: int) -> list[Sequence]:
    """The running sequences to preempt so that the waiting ones, in admission order, find a slot
    when they are more urgent than a running one; the least urgent first."""
    candidates = sorted(running, key=lambda seq: (seq.priority, seq.arrival), reverse=True)
    room = max_running - len(candidates)
    victims: list[Sequence] = []
    for seq in waiting:
        if room > 0:
            room -= 1
            continue
        if len(victims) == len(candidates) or candidates[len(victims)].priority <= seq.priority:
            break
        victims.append(candidates[len(victims)])
    return victims
