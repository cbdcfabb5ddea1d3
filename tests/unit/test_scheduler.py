"""Tests of the continuous-batching scheduler, driven by a fake model over a simulated paged cache.

The fake model (tests/unit/scheduler_helpers.py) writes each step's token ids into a cache addressed
through the sequences' block tables and "samples" a hash of the cached context read back the same
way. A wrong start, a lost or repeated token, or two sequences sharing a block change the outputs,
which are compared across KV budgets.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pydantic
import pytest

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.config import EngineConfig
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import FinishReason, Sequence, SequenceStatus, StepOutput
from strata.sampling import InvalidRequestError
from tests.scheduler_invariants import check_invariants
from tests.unit.scheduler_helpers import EOS, FakeModel, make_scheduler, make_seq, run_all, step


def test_engine_core_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import services.worker.engine.scheduler, services.worker.engine.block_manager\n"
        "import services.worker.engine.sequence, services.worker.engine.config\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_config_defaults_and_errors_name_the_fix() -> None:
    config = EngineConfig()
    assert (config.block_size, config.max_num_seqs, config.num_blocks, config.mixed_batches) == (
        16,
        64,
        None,
        True,
    )
    with pytest.raises(pydantic.ValidationError):
        config.block_size = 32  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="extra"):
        EngineConfig.model_validate({"blok_size": 16})
    with pytest.raises(
        pydantic.ValidationError,
        match=r"block_size=0 is invalid: must be a power of two.*STRATA_WORKER_ENGINE__BLOCK_SIZE",
    ):
        EngineConfig(block_size=0)
    with pytest.raises(pydantic.ValidationError, match="block_size=24"):
        EngineConfig(block_size=24)
    with pytest.raises(
        pydantic.ValidationError, match=r"max_num_batched_tokens=0 is invalid: must be >= 1.*e.g. 512"
    ):
        EngineConfig(max_num_batched_tokens=0)
    with pytest.raises(pydantic.ValidationError, match=r"decode_cost_tokens=0.5 is invalid: must be >= 1"):
        EngineConfig(decode_cost_tokens=0.5)
    assert EngineConfig(max_model_len=512).resolve_max_model_len(2048) == 512
    assert EngineConfig().resolve_max_model_len(2048) == 2048
    with pytest.raises(ValueError, match="max_model_len=4096 is invalid: the model's context is 2048"):
        EngineConfig(max_model_len=4096).resolve_max_model_len(2048)


def test_what_can_never_fit_is_refused_and_an_id_is_added_once() -> None:
    sched = make_scheduler(num_blocks=4, block_size=16, max_model_len=1000)
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        sched.check_fits(60, 10)  # 69 cached tokens need 5 blocks of 16
    sched.check_fits(60, 5)  # 64 cached tokens: exactly 4 blocks
    sched.add(make_seq("ok", 60, max_new=5))
    with pytest.raises(ValueError, match="already"):
        sched.add(make_seq("ok", 3))
    assert sched.num_waiting == 1
    with pytest.raises(ValueError, match="block_size=8 differs"):
        Scheduler(EngineConfig(), BlockManager(4, 8), max_model_len=64)


def test_token_budget_max_num_seqs_and_decodes_first() -> None:
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=512, max_num_batched_tokens=64, max_num_seqs=16)
    model = FakeModel(512, 16)
    for i in range(200):
        sched.add(make_seq(f"r{i}", rng.randint(1, 200), rng.randint(1, 12), arrival=i))
    steps = 0
    while sched.has_work:
        batch = sched.schedule()
        steps += 1
        assert 0 < batch.num_batched_tokens <= 64
        assert sched.num_running <= 16
        assert all(e.num_tokens == 1 and e.start > 0 for e in batch.entries[: batch.num_decodes])
        assert len({e.seq.request_id for e in batch.entries}) == len(batch.entries)
        for e in batch.entries:
            assert e.start == e.seq.num_computed_tokens
            assert e.sample == (e.start + e.num_tokens == e.seq.num_tokens)
        sched.postprocess(batch, model.run(batch))
        check_invariants(sched)
    assert steps > 200 / 16


def test_chunked_prefill_splits_a_long_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=256, block_size=16)
    model = FakeModel(256, 16)
    seq = make_seq("long", 1000, max_new=3)
    sched.add(seq)
    chunks = []
    for _ in range(4):
        batch, outputs = step(sched, model)
        (entry,) = batch.entries
        chunks.append((entry.start, entry.num_tokens, entry.sample))
        assert entry.token_ids == seq.prompt_ids[entry.start : entry.start + entry.num_tokens]
        assert len(seq.block_table) == -(-(entry.start + entry.num_tokens) // 16)
        assert bool(outputs) == entry.sample
    assert chunks == [(0, 256, False), (256, 256, False), (512, 256, False), (768, 232, True)]
    batch, _ = step(sched, model)
    assert (batch.num_decodes, batch.entries[0].start, batch.entries[0].token_ids) == (
        1,
        1000,
        seq.output_ids[:1],
    )


def test_decodes_come_before_a_new_prefill_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=128, decode_cost_tokens=1)
    model = FakeModel(256, 16)
    sched.add(make_seq("a", 10, max_new=20, arrival=0))
    sched.add(make_seq("b", 12, max_new=20, arrival=1))
    step(sched, model)
    sched.add(make_seq("c", 1000, max_new=2, arrival=2))
    batch, _ = step(sched, model)
    assert [e.seq.request_id for e in batch.entries] == ["a", "b", "c"]
    assert batch.num_decodes == 2
    assert [e.num_tokens for e in batch.entries] == [1, 1, 126]
    assert not batch.entries[2].sample


def test_decodes_leave_prefill_less_so_that_a_step_stays_bounded() -> None:
    """16 sequences decode while a 600-token prompt arrives: every step decodes all 16 and takes at
    most 128 - 2 x 16 = 96 prompt tokens, so its cost (decodes at 2 tokens each) never exceeds 128."""
    sched = make_scheduler(max_num_batched_tokens=128, decode_cost_tokens=2.0, max_num_seqs=32)
    model = FakeModel(256, 16)
    for i in range(16):
        sched.add(make_seq(f"d{i}", 4, max_new=100, arrival=i))
    step(sched, model)
    assert sched.stats.prefill_budget == 128 - 32
    long = make_seq("long", 600, max_new=2, arrival=99)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 600:
        batch, _ = step(sched, model)
        prefill = batch.num_batched_tokens - batch.num_decodes
        assert batch.num_decodes == 16
        assert prefill + 2 * batch.num_decodes <= 128
        chunks.append(prefill)
    assert chunks == [96] * 6 + [24]
    assert sched.limits.prefill_budget(num_decodes=70) == 16  # decodes past the budget still leave one block
    assert sched.limits.prefill_budget(num_decodes=0) == 128


def test_without_chunking_a_prompt_waits_for_a_whole_budget_unless_it_never_fits() -> None:
    sched = make_scheduler(max_num_batched_tokens=100, chunked_prefill=False)
    model = FakeModel(256, 16)
    sched.add(make_seq("a", 10, max_new=5, arrival=0))
    step(sched, model)
    sched.add(make_seq("b", 100, max_new=2, arrival=1))
    while sched.get("a") is not None:
        batch, _ = step(sched, model)
        assert [e.seq.request_id for e in batch.entries] == ["a"]  # 99 tokens left: b does not fit
    batch, _ = step(sched, model)
    assert [(e.seq.request_id, e.num_tokens) for e in batch.entries] == [("b", 100)]
    step(sched, model)
    sched.add(make_seq("huge", 250, max_new=1, arrival=2))
    sizes = [step(sched, model)[0].num_batched_tokens for _ in range(3)]
    assert sizes == [100, 100, 50]


def test_priority_then_fcfs() -> None:
    sched = make_scheduler(max_num_seqs=1)
    model = FakeModel(256, 16)
    for rid, priority, arrival in [("a", 1, 0), ("b", 0, 1), ("c", 1, 2), ("d", 0, 3), ("e", 0, 4)]:
        sched.add(make_seq(rid, 5, max_new=1, priority=priority, arrival=arrival))
    order = []
    while sched.has_work:
        batch, outputs = step(sched, model)
        order += [e.seq.request_id for e in batch.entries]
        assert all(o.finished and o.finish_reason is FinishReason.LENGTH for o in outputs)
    assert order == ["b", "d", "e", "a", "c"]


def test_finish_reasons() -> None:
    sched = make_scheduler(max_model_len=64)
    seqs = {
        "eos": make_seq("eos", 5, max_new=10),
        "ignore": make_seq("ignore", 5, max_new=4, ignore_eos=True),
        "stop": make_seq("stop", 5, max_new=10, stop_token_ids=(7,)),
        "length": make_seq("length", 5, max_new=3),
        "context": make_seq("context", 60, max_new=4),
    }
    for seq in seqs.values():
        sched.add(seq)
    script = {"eos": [11, EOS], "ignore": [EOS, EOS, 12, EOS], "stop": [11, 12, 7], "length": [11, 12, 13]}
    results: dict[str, StepOutput] = {}
    while sched.has_work:
        batch = sched.schedule()
        sampled = [
            script.get(e.seq.request_id, [11] * 9)[e.seq.num_output_tokens] for e in batch.entries if e.sample
        ]
        for out in sched.postprocess(batch, sampled):
            if out.finished:
                results[out.request_id] = out
    assert {rid: out.finish_reason for rid, out in results.items()} == {
        "eos": FinishReason.STOP,
        "ignore": FinishReason.LENGTH,
        "stop": FinishReason.STOP,
        "length": FinishReason.LENGTH,
        "context": FinishReason.LENGTH,
    }
    assert seqs["eos"].output_ids == [11, EOS]
    assert seqs["stop"].output_ids == [11, 12, 7]
    assert results["length"].num_output_tokens == 3 and results["length"].num_prompt_tokens == 5
    assert seqs["context"].num_tokens == 64
    assert sched.block_manager.num_free_blocks == 256


def test_unmixed_batches_alternate_prefill_and_decode() -> None:
    def seqs() -> list[Sequence]:
        return [make_seq(f"r{i}", 100, max_new=6, arrival=i) for i in range(8)]

    expected = run_all(make_scheduler(max_num_batched_tokens=64), seqs())
    sched = make_scheduler(mixed_batches=False, max_num_batched_tokens=64)
    model = FakeModel(256, 16)
    for seq in seqs():
        sched.add(seq)
    kinds: list[str] = []
    streamed: dict[str, list[int]] = {f"r{i}": [] for i in range(8)}
    while sched.has_work:
        running = sched.running
        has_prefill = bool(sched.waiting) or any(s.num_new_tokens_to_compute > 1 for s in running)
        has_decode = any(s.num_new_tokens_to_compute == 1 for s in running)
        batch, outputs = step(sched, model)
        is_decode = batch.num_decodes == len(batch.entries)
        assert is_decode or batch.num_decodes == 0, "a step mixed decodes with prefill"
        kind = "decode" if is_decode else "prefill"
        if has_prefill and has_decode:
            assert kind != kinds[-1]
        else:
            assert kind == ("prefill" if has_prefill else "decode")
        kinds.append(kind)
        for out in outputs:
            streamed[out.request_id] += out.new_token_ids
    assert streamed == expected
    assert kinds.count("prefill") >= 13 and kinds.count("decode") >= 13


def test_shed_load_preempts_the_newest_then_recovers() -> None:
    def seqs() -> list[Sequence]:
        return [make_seq(f"r{i}", 20, max_new=40, arrival=i) for i in range(8)]

    expected = run_all(make_scheduler(max_num_seqs=8), seqs())
    sched = make_scheduler(max_num_seqs=8, shed_recovery_steps=3)
    model = FakeModel(256, 16)
    batch_seqs = seqs()
    for seq in batch_seqs:
        sched.add(seq)
    step(sched, model)
    failed = sched.schedule()  # the runner "runs out of memory": postprocess is never called
    starts = {e.seq.request_id: e.start for e in failed.entries}
    victims = sched.shed_load()
    assert [v.request_id for v in victims] == ["r4", "r5", "r6", "r7"]
    assert all(v.status is SequenceStatus.WAITING and not v.block_table for v in victims)
    assert [s.request_id for s in sched.waiting] == ["r4", "r5", "r6", "r7"]
    assert sched.stats.effective_max_num_seqs == 4
    check_invariants(sched)
    free_before = sched.block_manager.num_free_blocks
    retry = sched.schedule()  # survivors run again from the same place, with the blocks they kept
    assert {e.seq.request_id: e.start for e in retry.entries} == {f"r{i}": starts[f"r{i}"] for i in range(4)}
    assert sched.block_manager.num_free_blocks == free_before
    streamed = {s.request_id: list(s.output_ids) for s in batch_seqs}
    for out in sched.postprocess(retry, model.run(retry)):
        streamed[out.request_id] += out.new_token_ids
    limits = []
    while sched.has_work:
        _, outputs = step(sched, model)
        assert sched.num_running <= sched.stats.effective_max_num_seqs
        limits.append(sched.stats.effective_max_num_seqs)
        for out in outputs:
            streamed[out.request_id] += out.new_token_ids
    assert limits[:6] == [4, 5, 5, 5, 6, 6]
    assert limits[-1] == 8
    assert streamed == expected
    assert sched.stats.num_load_sheds == 1


def test_shed_load_keeps_at_least_one_running() -> None:
    sched = make_scheduler(max_num_seqs=8)
    model = FakeModel(256, 16)
    for i in range(3):
        sched.add(make_seq(f"r{i}", 5, max_new=20, arrival=i))
    step(sched, model)
    assert [v.request_id for v in sched.shed_load()] == ["r1", "r2"]
    assert sched.stats.effective_max_num_seqs == 1
    assert sched.shed_load() == []  # the last one stays: the engine decides what a lone failure means
    assert (sched.num_running, sched.stats.effective_max_num_seqs, sched.stats.num_load_sheds) == (1, 1, 2)
    check_invariants(sched)


def test_postprocess_refuses_a_stale_or_mismatched_step() -> None:
    sched = make_scheduler()
    model = FakeModel(256, 16)
    sched.add(make_seq("a", 5))
    batch = sched.schedule()
    with pytest.raises(ValueError, match="sampled tokens"):
        sched.postprocess(batch, [])
    sampled = model.run(batch)
    sched.postprocess(batch, sampled)
    with pytest.raises(RuntimeError, match="stale"):
        sched.postprocess(batch, sampled)


def test_abort_between_schedule_and_postprocess_drops_the_result() -> None:
    sched = make_scheduler()
    model = FakeModel(256, 16)
    sched.add(make_seq("a", 5))
    sched.add(make_seq("b", 5, arrival=1))
    batch = sched.schedule()
    sampled = model.run(batch)
    assert sched.abort("a")
    outputs = sched.postprocess(batch, sampled)
    assert [o.request_id for o in outputs] == ["b"]
    check_invariants(sched)
    assert sched.block_manager.num_used_blocks == 1
