"""Tests of yielding: a waiting sequence of another tenant takes running slots and KV blocks from the
tenant holding the most, until the split is even, and only when that frees enough. Driven through the
scheduler with the fake model (tests/unit/scheduler_helpers.py), so a wrong preemption changes the
outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.unit.scheduler_helpers import FakeModel, make_scheduler, make_seq, run_all, step

if TYPE_CHECKING:
    from services.worker.engine.sequence import Sequence


def tenant_seq(tenant: str, rid: str, prompt_len: int, max_new: int, priority: int, arrival: int) -> Sequence:
    seq = make_seq(rid, prompt_len, max_new=max_new, priority=priority, arrival=arrival)
    seq.cache_salt = tenant
    return seq


def test_a_more_urgent_arrival_of_another_tenant_takes_the_slot_of_the_youngest_flooding_sequence() -> None:
    """With every running slot held by tenant a's priority-1 streams, tenant b's priority-0 arrival runs
    in the next step: a's youngest stream is preempted, resumes once b's ends (from its prefix-cached
    blocks), and every stream's tokens equal those of a run where nobody was preempted. An arrival of
    the running streams' own priority waits, and so does a more urgent one of tenant a itself."""

    def seqs() -> list[Sequence]:
        return [tenant_seq("a", f"low{i}", 40, 30, priority=1, arrival=i) for i in range(3)]

    urgent = tenant_seq("b", "urgent", 20, 5, priority=0, arrival=9)
    expected = run_all(make_scheduler(max_num_seqs=4), [*seqs(), urgent])
    sched = make_scheduler(max_num_seqs=3)
    model = FakeModel(256, 16)
    for seq in seqs():
        sched.add(seq)
    streamed: dict[str, list[int]] = {}

    def run_step() -> set[str]:
        batch, outputs = step(sched, model)
        for out in outputs:
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
        return {e.seq.request_id for e in batch.entries}

    for _ in range(3):
        run_step()
    assert sched.num_running == 3
    for rid, tenant, priority in (("same", "b", 1), ("own", "a", 0)):
        sched.add(tenant_seq(tenant, rid, 20, 5, priority=priority, arrival=8))
        assert rid not in run_step()
        sched.abort(rid)
    sched.add(tenant_seq("b", "urgent", 20, 5, priority=0, arrival=9))
    assert "urgent" in run_step()
    assert [s.request_id for s in sched.waiting] == ["low2"]
    assert sched.stats.num_preemptions == 1
    while sched.has_work:
        run_step()
    assert streamed == expected
    assert sched.stats.prefix_hit_blocks == 0, "a resumed victim is not a client's prompt served from cache"


def test_preemption_stops_at_an_even_split_and_takes_nobody_when_it_would_not_be_enough() -> None:
    """Tenant b's urgent arrivals take a's slots only while a holds at least two more than b, so the
    running slots end even; and an arrival whose prompt needs more blocks than every victim would free
    preempts nobody."""
    sched = make_scheduler(max_num_seqs=4)
    model = FakeModel(256, 16)
    for i in range(4):
        sched.add(tenant_seq("a", f"a{i}", 16, 60, priority=1, arrival=i))
    step(sched, model)
    for i in range(3):
        sched.add(tenant_seq("b", f"b{i}", 16, 60, priority=0, arrival=10 + i))
    for _ in range(4):
        step(sched, model)
    running = [s.cache_salt for s in sched.running]
    assert sorted(running) == ["a", "a", "b", "b"], running
    assert sched.stats.num_preemptions == 2

    tight = make_scheduler(num_blocks=8, block_size=16, max_num_seqs=4)
    small = FakeModel(8, 16)
    tight.add(tenant_seq("a", "x", 40, 60, priority=1, arrival=0))
    step(tight, small)
    tight.add(tenant_seq("b", "huge", 200, 4, priority=0, arrival=1))
    step(tight, small)
    assert tight.stats.num_preemptions == 0 and [s.request_id for s in tight.running] == ["x"]
