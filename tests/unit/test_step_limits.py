"""The caps an inter-token SLO puts on a step (step_limits.py), steered by the steps' measured cadence,
and the scheduler obeying them.

A step is planned to last ITL_HEADROOM of the tightest SLO among the running sequences. The tests feed
StepLimits the cadences a worker would measure, from a made-up machine where a decode costs 2 ms, a
step 20 ms, and a step with prefill 60 ms more plus 0.5 ms a prompt token (the CPU's shape: prefill
leaves the fused decode path), and check where the caps settle. Without an SLO among the sequences the
limits are the token budget and the running limit as ever.
"""

from __future__ import annotations

from services.worker.engine.step_limits import ITL_HEADROOM, StepLimits
from tests.unit.scheduler_helpers import FakeModel, make_scheduler, make_seq, step

SLO = 0.150
PLAN = SLO * ITL_HEADROOM


def cadence(decodes: int, prefill: int) -> float:
    """The made-up machine's step, start to next start."""
    return 0.020 + 0.002 * decodes + (0.060 + 0.0005 * prefill if prefill else 0.0)


def limits(**config: int) -> StepLimits:
    return make_scheduler(**config).limits


def drive(step_limits: StepLimits, steps: int, wanting: int = 64, prompt_every: int = 3) -> list[float]:
    """`steps` steps of a batch that runs as many of `wanting` sequences as the limit allows, one in
    `prompt_every` carrying as much prefill as the cap allows; returns each step's cadence."""
    seen = []
    for index in range(steps):
        decodes = min(wanting, step_limits.max_running(SLO))
        prefill = step_limits.prefill_budget(decodes, SLO) if index % prompt_every == 0 else 0
        seconds = cadence(decodes, prefill)
        step_limits.paced(seconds, decodes, prefill, SLO)
        seen.append(seconds)
    return seen


def test_the_caps_settle_where_steps_keep_the_plan_and_bind_only_under_an_slo() -> None:
    step_limits = limits(max_num_seqs=64, max_num_batched_tokens=512)
    assert step_limits.max_running(SLO) == 1  # slow start: one sequence until steps are measured
    assert step_limits.max_running(None) == 64 and step_limits.prefill_budget(0, None) == 512
    seen = drive(step_limits, 400)
    settled = seen[-120:]
    assert max(settled) <= 1.15 * PLAN, max(settled)  # within the plan, give or take a probe
    running = step_limits.max_running(SLO)
    assert cadence(running, 16) <= 1.15 * PLAN and running >= 5  # not collapsed: room was left used
    assert step_limits.prefill_budget(running, SLO) < 512 - 2 * running  # prefill is capped too
    # No SLO among the sequences: the caps do not bind.
    assert step_limits.max_running(None) == 64
    assert step_limits.prefill_budget(running, None) == 512 - 2 * running


def test_a_block_of_prefill_that_alone_takes_the_plan_does_not_collapse_the_batch() -> None:
    """When even one block of prefill beside one decode runs past the plan, cutting decodes does not
    lower the pace, so the running limit stops falling instead of serving one sequence at a time."""
    step_limits = limits(max_num_seqs=64)
    for _ in range(60):  # slow start up to a few sequences on decode-only steps
        decodes = min(12, step_limits.max_running(SLO))
        step_limits.paced(cadence(decodes, 0), decodes, 0, SLO)
    grown = step_limits.max_running(SLO)
    assert grown >= 8
    for _ in range(200):  # every step now carries a block that costs the whole plan
        decodes = step_limits.max_running(SLO)
        step_limits.paced(PLAN + 0.030 + 0.002 * decodes, decodes, 16, SLO)
    assert step_limits.max_running(SLO) >= grown // 4


def test_the_scheduler_runs_no_more_than_the_limit_and_chunks_prefill_by_the_cap() -> None:
    sched = make_scheduler(max_num_batched_tokens=512, max_num_seqs=64)
    model = FakeModel(256, 16)
    sched.limits.paced_limit = 5
    sched.limits.paced_prefill = 48
    for i in range(12):
        seq = make_seq(f"s{i}", 8, max_new=6, arrival=i)
        seq.itl_slo_s = SLO
        sched.add(seq)
    sched.add(make_seq("long", 300, max_new=2, arrival=99))  # no SLO of its own: the others' binds
    while sched.has_work:
        batch, _ = step(sched, model)
        if any(s.itl_slo_s for s in sched.running):
            assert sched.num_running <= 5
            assert batch.num_batched_tokens - batch.num_decodes <= 48
    assert sched.stats.effective_max_num_seqs == 64  # no step kept an SLO: nothing to report


def test_an_idle_worker_reports_the_pace_it_kept_but_runs_requests_without_an_slo_unpaced() -> None:
    """Between two requests of an SLO route the worker reports the limits it kept for them, so that a
    gateway does not send a burst into slots the next step would not run; a request without an SLO
    still runs as many at once as the token budget and max_num_seqs allow."""
    sched = make_scheduler(max_num_batched_tokens=512, max_num_seqs=64)
    sched.limits.paced(cadence(1, 0), 1, 0, SLO)  # one step kept the SLO: the limit is still slow start's
    assert sched.stats.effective_max_num_seqs == 1 and sched.stats.prefill_budget == 512
    model = FakeModel(256, 16)
    for i in range(8):
        sched.add(make_seq(f"d{i}", 4, max_new=3, arrival=i))
    batch, _ = step(sched, model)
    assert len(batch.entries) == 8


def test_without_an_slo_the_step_is_the_token_budget_as_before() -> None:
    sched = make_scheduler(max_num_batched_tokens=512, max_num_seqs=64)
    sched.limits.paced_limit = 2
    sched.limits.paced_prefill = 16
    model = FakeModel(256, 16)
    for i in range(8):
        sched.add(make_seq(f"d{i}", 4, max_new=50, arrival=i))
    step(sched, model)
    sched.add(make_seq("long", 600, max_new=2, arrival=99))
    batch, _ = step(sched, model)
    assert batch.num_batched_tokens - batch.num_decodes == 512 - 2 * 8
    assert sched.stats.effective_max_num_seqs == 64
