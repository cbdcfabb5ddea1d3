"""Tests of KV block accounting: the block manager alone (allocation, growth, credits, misuse), then
the scheduler when blocks run out (preemption by recompute, victims, no leaks after aborts).

The scheduler cases use the scheduler tests' fake model (tests/unit/scheduler_helpers.py), whose
outputs depend on every cached token read back through the block tables, so a lost, repeated or
misplaced token changes them.
"""

from __future__ import annotations

import random

import pytest

from services.worker.engine.block_manager import BlockAccountingError, BlockManager, NoFreeBlocksError
from services.worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from strata.sampling import SamplingParams
from tests.scheduler_invariants import check_invariants
from tests.unit.scheduler_helpers import FakeModel, make_scheduler, run_all, step
from tests.unit.scheduler_helpers import make_seq as make_request


def make_seq(request_id: str) -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams())


def test_allocate_grow_and_free() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq("a")
    assert bm.allocate_for(seq, 5) == [0, 1]  # block 0 is an ordinary block
    assert seq.block_table == [0, 1]
    assert bm.allocate_for(seq, 8) == []  # 8 tokens still fit in two blocks of 4
    assert bm.allocate_for(seq, 9) == [2]
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 7
    assert bm.num_used_blocks == 3
    assert bm.holds(seq)
    assert bm.free(seq) == 3
    assert seq.block_table == []
    assert not bm.holds(seq)
    assert bm.num_free_blocks == 10
    bm.check_invariants([seq])


def test_credits_are_exact() -> None:
    bm = BlockManager(num_blocks=6, block_size=16)
    assert bm.free_tokens == 96
    assert bm.can_allocate(96)
    assert not bm.can_allocate(97)
    seq = make_seq("a")
    bm.allocate_for(seq, 17)
    assert bm.free_tokens == 4 * 16
    assert bm.usage == pytest.approx(2 / 6)
    assert bm.blocks_to_grow(seq, 33) == 1
    assert bm.capacity_for(seq) == 6 * 16
    assert bm.can_grow(seq, 96)
    assert not bm.can_grow(seq, 97)


def test_too_many_blocks_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq("a")
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_for(seq, 13)
    assert seq.block_table == []
    assert bm.num_free_blocks == 3
    bm.check_invariants([seq])


def test_double_free_raises() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq("a")
    bm.allocate_for(seq, 4)
    bm.free(seq)
    with pytest.raises(BlockAccountingError, match="freed twice"):
        bm.free(seq)
    assert bm.num_free_blocks == 4


def test_freeing_a_foreign_block_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq("a"), make_seq("b")
    bm.allocate_for(a, 4)
    bm.allocate_for(b, 4)
    b.block_table[0] = a.block_table[0]
    with pytest.raises(BlockAccountingError, match="not its own"):
        bm.free(b)
    assert bm.num_free_blocks == 2
    b.block_table.append(3)  # a block that is free, claimed without allocation
    with pytest.raises(BlockAccountingError):
        bm.free(b)
    assert bm.num_free_blocks == 2


def test_tampered_table_is_refused_on_growth() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq("a")
    seq.block_table.append(2)
    with pytest.raises(BlockAccountingError):
        bm.allocate_for(seq, 8)


def test_free_list_is_lifo() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq("a"), make_seq("b")
    bm.allocate_for(a, 8)
    bm.allocate_for(b, 4)
    freed = list(a.block_table)
    bm.free(a)
    c = make_seq("c")
    assert bm.allocate_for(c, 4) == [freed[-1]]


def test_check_invariants_catches_a_leak() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq("a"), make_seq("b")
    bm.allocate_for(a, 4)
    bm.allocate_for(b, 4)
    bm.check_invariants([a, b])
    with pytest.raises(BlockAccountingError, match="does not know"):
        bm.check_invariants([a])


def test_invalid_geometry_is_refused() -> None:
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(num_blocks=0, block_size=16)
    with pytest.raises(ValueError, match="block_size=0"):
        BlockManager(num_blocks=1, block_size=0)


def test_invariants_hold_after_random_operations() -> None:
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=64, block_size=8)
    live: dict[str, tuple[Sequence, int]] = {}
    next_id = 0
    allocations = frees = refusals = 0
    for _ in range(4000):
        roll = rng.random()
        if roll < 0.45 or not live:
            seq = make_seq(f"r{next_id}")
            next_id += 1
            tokens = rng.randint(1, 80)
            if bm.can_allocate(tokens):
                bm.allocate_for(seq, tokens)
                live[seq.request_id] = (seq, tokens)
                allocations += 1
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate_for(seq, tokens)
                refusals += 1
        elif roll < 0.75:
            seq, tokens = live[rng.choice(sorted(live))]
            grown = tokens + rng.randint(1, 20)
            if bm.can_grow(seq, grown):
                before = len(seq.block_table)
                added = bm.allocate_for(seq, grown)
                assert len(seq.block_table) == before + len(added) == bm.blocks_needed(grown)
                live[seq.request_id] = (seq, grown)
        else:
            seq, _ = live.pop(rng.choice(sorted(live)))
            bm.free(seq)
            frees += 1
        holders = [s for s, _ in live.values()]
        bm.check_invariants(holders)
        assert bm.num_free_blocks + sum(len(s.block_table) for s in holders) == 64
        assert bm.free_tokens == bm.num_free_blocks * 8
    for seq, _ in live.values():
        bm.free(seq)
    assert bm.num_free_blocks == 64
    bm.check_invariants([])
    assert allocations > 500 and frees > 300 and refusals > 0


def test_preemption_requeues_the_victim_at_the_front_and_loses_nothing() -> None:
    def seqs() -> list[Sequence]:
        shapes = [("a", 0), ("b", 5), ("c", 2)]
        return [make_request(rid, 4, max_new=8, arrival=arrival) for rid, arrival in shapes]

    expected = run_all(make_scheduler(num_blocks=64, block_size=4), seqs())
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    model = FakeModel(4, 4)
    a, b, c = seqs()
    sched.add(a)
    sched.add(b)
    streamed: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    preempted_batch = None
    while sched.has_work:
        batch, outputs = step(sched, model)
        if sched.stats.num_steps == 1:
            sched.add(c)  # it arrived earlier than b by the counter, but reaches the engine later
        for out in outputs:
            streamed[out.request_id] += out.new_token_ids
        if batch.preempted and preempted_batch is None:
            preempted_batch = batch
            assert batch.preempted == [b]  # the same priority, the later arrival
            assert (b.status, b.num_computed_tokens, b.block_table, b.num_preemptions) == (
                SequenceStatus.WAITING,
                0,
                [],
                1,
            )
            assert [s.request_id for s in sched.waiting] == ["b", "c"]  # front of its priority
    assert preempted_batch is not None
    assert streamed == expected
    assert all(len(s.all_token_ids) == 12 for s in (a, b, c))
    assert sched.block_manager.num_free_blocks == 4


def test_victims_are_the_least_urgent_then_the_latest() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4)
    model = FakeModel(6, 4)
    for rid, priority, arrival in [("x", 0, 0), ("y", 1, 1), ("z", 0, 2)]:
        sched.add(make_request(rid, 4, max_new=12, priority=priority, arrival=arrival))
    victims = []
    while sched.has_work:
        batch, _ = step(sched, model)
        victims += [v.request_id for v in batch.preempted]
        decodes = [e.seq.request_id for e in batch.entries[: batch.num_decodes]]
        assert decodes == sorted(decodes, key="xzy".index)  # most urgent first
    assert victims[:2] == ["y", "z"]


def test_a_preempting_step_admits_no_one() -> None:
    """y is preempted for x's next block; w, of y's priority, would fit in y's blocks, yet waits."""
    sched = make_scheduler(num_blocks=4, block_size=4)
    model = FakeModel(4, 4)
    sched.add(make_request("x", 1, max_new=6, priority=0, arrival=0))
    sched.add(make_request("y", 4, max_new=6, priority=2, arrival=1))
    step(sched, model)
    sched.add(make_request("w", 5, max_new=6, priority=2, arrival=2))
    while True:
        batch, _ = step(sched, model)
        if batch.preempted:
            break
    assert [v.request_id for v in batch.preempted] == ["y"]
    assert [e.seq.request_id for e in batch.entries] == ["x"]
    assert [s.request_id for s in sched.waiting] == ["y", "w"]  # the victim resumes first


def test_a_more_urgent_arrival_takes_the_blocks_of_a_less_urgent_sequence_at_once() -> None:
    """With every block held by tenant "", w (priority 1, another tenant) preempts y (priority 2) at
    the start of the next step and starts in it; y waits behind it and resumes when x ends."""
    sched = make_scheduler(num_blocks=4, block_size=4)
    model = FakeModel(4, 4)
    sched.add(make_request("x", 1, max_new=6, priority=0, arrival=0))
    sched.add(make_request("y", 4, max_new=6, priority=2, arrival=1))
    step(sched, model)
    w = make_request("w", 5, max_new=6, priority=1, arrival=2)
    w.cache_salt = "another tenant"
    sched.add(w)
    batch, _ = step(sched, model)
    assert not batch.preempted  # a yield is not a step's preemption for room: it may admit
    assert [(e.seq.request_id, e.start) for e in batch.entries] == [("x", 1), ("w", 0)]
    assert [s.request_id for s in sched.waiting] == ["y"]
    while sched.has_work:
        step(sched, model)
    assert sched.stats.num_preemptions >= 1


def test_a_third_of_the_kv_needed_still_gives_the_same_outputs() -> None:
    rng = random.Random(99)
    shapes = [(rng.randint(20, 60), rng.randint(20, 40)) for _ in range(30)]

    def seqs() -> list[Sequence]:
        return [make_request(f"r{i}", p, m, arrival=i) for i, (p, m) in enumerate(shapes)]

    need = sum(-(-(p + m - 1) // 8) for p, m in shapes)
    ample = make_scheduler(num_blocks=need, block_size=8, max_num_batched_tokens=128)
    expected = run_all(ample, seqs())
    assert ample.stats.num_preemptions == 0
    tight = make_scheduler(num_blocks=need // 3, block_size=8, max_num_batched_tokens=128)
    assert run_all(tight, seqs()) == expected
    assert tight.stats.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == need // 3


@pytest.mark.parametrize("mixed", [True, False])
def test_thousand_requests_with_aborts_and_failed_steps_leave_nothing_behind(mixed: bool) -> None:
    rng = random.Random(2024)
    sched = make_scheduler(
        num_blocks=96, block_size=8, max_num_batched_tokens=96, max_num_seqs=24, mixed_batches=mixed
    )
    model = FakeModel(96, 8)
    pending = [
        make_request(f"r{i}", rng.randint(1, 60), rng.randint(1, 16), priority=rng.randint(0, 2), arrival=i)
        for i in range(1000)
    ]
    pending.reverse()
    finished: dict[str, FinishReason] = {}
    aborted = 0
    for _ in range(20_000):
        for _ in range(rng.randint(0, 4)):
            if pending:
                sched.add(pending.pop())
        live = sched.running + sched.waiting
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            assert sched.abort(victim.request_id)
            assert (victim.status, victim.finish_reason, victim.block_table) == (
                SequenceStatus.FINISHED,
                FinishReason.ABORTED,
                [],
            )
            assert not sched.abort(victim.request_id)
            finished[victim.request_id] = FinishReason.ABORTED
            aborted += 1
        check_invariants(sched)
        if not sched.has_work and not pending:
            break
        if rng.random() < 0.02:
            sched.schedule()  # a step that runs out of memory: no postprocess, the load is shed
            sched.shed_load()
            continue
        _, outputs = step(sched, model)
        for out in outputs:
            if out.finished:
                assert out.finish_reason is FinishReason.LENGTH
                finished[out.request_id] = out.finish_reason
    assert len(finished) == 1000 and aborted > 50
    assert sched.stats.num_preemptions > 0 and sched.stats.num_load_sheds > 5
    assert (sched.num_running, sched.num_waiting) == (0, 0)
    assert sched.block_manager.num_free_blocks == 96
    sched.block_manager.check_invariants([])


def test_partial_prefill_shrinks_to_the_free_blocks_then_waits() -> None:
    def seqs() -> list[Sequence]:
        return [make_request("x", 4, max_new=8, arrival=0), make_request("w", 16, max_new=1, arrival=1)]

    # A decode costs one token of the budget here, so the chunks are the free blocks' alone.
    expected = run_all(make_scheduler(max_num_batched_tokens=8, block_size=4, decode_cost_tokens=1), seqs())
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=8, decode_cost_tokens=1)
    model = FakeModel(5, 4)
    x, w = seqs()
    sched.add(x)
    sched.add(w)
    chunks = []
    for _ in range(4):
        batch, _ = step(sched, model)
        chunks.append([(e.seq.request_id, e.start, e.num_tokens) for e in batch.entries])
    assert chunks == [
        [("x", 0, 4), ("w", 0, 4)],
        [("x", 4, 1), ("w", 4, 7)],
        [("x", 5, 1), ("w", 11, 1)],  # the budget allows 6 more, the free blocks only 1
        [("x", 6, 1)],  # no block left: w keeps its place and waits
    ]
    while sched.has_work:
        step(sched, model)
    assert {"x": x.output_ids, "w": w.output_ids} == expected
    assert w.num_preemptions == 1  # x's decode later needed w's blocks
