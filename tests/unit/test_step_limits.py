"""The caps an inter-token SLO puts on a step (step_limits.py), and the scheduler obeying them.

With the step-time line fixed + per_decode x decodes + per_token x prefill tokens and an SLO, a step is
planned to last at most ITL_HEADROOM of the SLO: its prefill is cut to what fits beside its decodes,
and no sequence is admitted past the decodes that fit beside one block of prefill. Without an SLO
among the sequences, or before a fit, the limits are the token budget and the running limit as ever.
"""

from __future__ import annotations

import math

import pytest

from services.worker.engine.step_limits import ITL_HEADROOM, StepLimits
from tests.unit.scheduler_helpers import FakeModel, make_scheduler, make_seq, step

LINE = (0.020, 0.002, 0.0005)
"""20 ms a step, 2 ms a decode, 0.5 ms a prefill token."""


def planned_s(decodes: int, prefill: int) -> float:
    fixed, per_decode, per_token = LINE
    return fixed + per_decode * decodes + per_token * prefill


def limits(**config: int) -> StepLimits:
    return make_scheduler(**config).limits


def test_an_slo_cuts_prefill_to_what_fits_beside_the_decodes() -> None:
    slo = 0.150
    step_limits = limits(max_num_batched_tokens=512)
    assert step_limits.prefill_budget(40, slo) == 512 - 80  # no fit yet: the token budget alone
    step_limits.cost = LINE
    budget = step_limits.prefill_budget(40, slo)
    assert budget == math.floor((ITL_HEADROOM * slo - planned_s(40, 0)) / LINE[2])
    assert planned_s(40, budget) <= ITL_HEADROOM * slo < planned_s(40, budget + 1)
    assert step_limits.prefill_budget(40, None) == 512 - 80  # no SLO among the sequences: no cap
    assert step_limits.prefill_budget(40, 0.001) == 16  # an SLO no step can keep: one block still goes


def test_an_slo_caps_the_running_sequences_at_the_decodes_a_step_holds_beside_one_block() -> None:
    slo = 0.150
    step_limits = limits(max_num_seqs=64)
    step_limits.cost = LINE
    most = step_limits.max_running(slo)
    assert 1 <= most < 64
    assert planned_s(most, 16) <= ITL_HEADROOM * slo < planned_s(most + 1, 16)
    assert step_limits.max_running(None) == 64
    assert step_limits.max_running(0.001) == 1  # one sequence always runs
    step_limits.shed(10)  # load shedding's limit still binds when it is lower
    assert step_limits.max_running(slo) == 10


@pytest.mark.parametrize("mixed", [True, False])
def test_the_scheduler_keeps_every_step_within_the_slo_of_the_streams_it_decodes(mixed: bool) -> None:
    """Sequences with a 150 ms SLO arrive beside long prompts of sequences without one: no step is
    planned past the headroom (the one-block floor aside), the running ones never exceed the cap, and
    every sequence still finishes."""
    slo = 0.150
    sched = make_scheduler(max_num_batched_tokens=512, max_num_seqs=64, mixed_batches=mixed)
    sched.limits.cost = LINE
    model = FakeModel(256, 16)
    cap = sched.limits.max_running(slo)
    names = []
    for i in range(cap + 10):
        seq = make_seq(f"s{i}", 8, max_new=12, arrival=i)
        seq.itl_slo_s = slo
        sched.add(seq)
        names.append(seq.request_id)
    for i in range(3):
        sched.add(make_seq(f"long{i}", 300, max_new=4, arrival=100 + i))
    prefill_steps = 0
    while sched.has_work:
        batch, _ = step(sched, model)
        assert sched.num_running <= cap
        prefill = batch.num_batched_tokens - batch.num_decodes
        if batch.num_decodes and any(e.seq.itl_slo_s for e in batch.entries):
            assert prefill <= 16 or planned_s(batch.num_decodes, prefill) <= ITL_HEADROOM * slo
        prefill_steps += prefill > 0
    assert all(sched.get(name) is None for name in names)
    assert prefill_steps > 3 * 300 // 512  # the long prompts went in smaller chunks than the budget


def test_without_an_slo_the_step_is_the_token_budget_as_before() -> None:
    sched = make_scheduler(max_num_batched_tokens=512, max_num_seqs=64)
    sched.limits.cost = LINE
    model = FakeModel(256, 16)
    for i in range(8):
        sched.add(make_seq(f"d{i}", 4, max_new=50, arrival=i))
    step(sched, model)
    sched.add(make_seq("long", 600, max_new=2, arrival=99))
    batch, _ = step(sched, model)
    assert batch.num_batched_tokens - batch.num_decodes == 512 - 2 * 8
    assert sched.stats.effective_max_num_seqs == 64
