"""The time-to-first-token forecast alone: a stream's LinkLoad followed from worker messages, and the
replay of free slots behind the queue. No I/O."""

from __future__ import annotations

import pytest

from gateway.admission import Ticket
from gateway.forecast import MARGIN_AGE_S, MARGIN_MIN_SAMPLES, LinkLoad, LinkView, forecast
from strata.v1 import common_pb2, worker_pb2


def ticket(name: str, prompt: int = 32, new: int = 10) -> Ticket:
    return Ticket(request_id=name, prompt_tokens=prompt, max_new_tokens=new)


def submission(name: str, prompt: int = 32, new: int = 10, prior: int = 0) -> worker_pb2.Submission:
    return worker_pb2.Submission(
        request_id=name,
        prompt_ids=[1] * prompt,
        sampling=common_pb2.SamplingParams(max_new_tokens=new),
        prior_output_ids=[2] * prior,
    )


def step(duration_ms: float, *, max_running: int = 4, prefill_budget: int = 64) -> worker_pb2.StepInfo:
    return worker_pb2.StepInfo(
        duration_ms=duration_ms, max_running=max_running, prefill_budget=prefill_budget
    )


def progress(load: LinkLoad, name: str, output_tokens: int, *, finished: bool = False) -> None:
    update = worker_pb2.TokenUpdate(request_id=name, output_tokens=output_tokens, finished=finished)
    load.observe(worker_pb2.ConnectResponse(updates=[update]), 0.0)


def test_the_step_time_is_a_moving_average_of_reported_steps() -> None:
    load = LinkLoad()
    assert load.step_s is None
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, max_running=8, prefill_budget=48)), 0.0)
    assert load.step_s == pytest.approx(0.1)
    assert (load.max_running, load.prefill_budget) == (8, 48)
    load.observe(worker_pb2.ConnectResponse(step=step(200.0)), 0.0)
    assert load.step_s == pytest.approx(0.1 + 0.3 * 0.1)
    load.observe(worker_pb2.ConnectResponse(), 0.0)  # a message without a step changes nothing
    assert load.step_s == pytest.approx(0.13)


def test_the_hellos_step_is_replaced_by_the_first_step_of_the_stream() -> None:
    load = LinkLoad()
    hello = worker_pb2.ConnectResponse(hello=worker_pb2.WorkerHello(), step=step(5.0))
    load.observe(hello, 0.0)  # the worker's warm-up: one short prompt alone
    assert load.step_s == pytest.approx(0.005)
    load.observe(worker_pb2.ConnectResponse(step=step(150.0)), 0.0)
    assert load.step_s == pytest.approx(0.15)
    load.observe(worker_pb2.ConnectResponse(step=step(250.0)), 0.0)
    assert load.step_s == pytest.approx(0.15 + 0.3 * 0.1)


def test_no_forecast_before_any_step_report() -> None:
    load = LinkLoad()
    assert forecast([LinkView(load, slots=4, free_credits=4)], [], ticket("t")) is None


def test_a_free_slot_starts_now_and_the_first_token_follows_its_prefill() -> None:
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, prefill_budget=16)), 0.0)
    got = forecast([LinkView(load, slots=4, free_credits=4)], [], ticket("t", prompt=40))
    assert got is not None
    # The step in progress, then ceil(40 / 16) = 3 prefill chunks.
    assert got.start_s == 0.0 and got.ttft_s == pytest.approx(0.4)


def test_prompts_not_yet_prefilled_share_the_chunks_of_a_ticket_that_starts_now() -> None:
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, prefill_budget=32)), 0.0)
    load.sent(submission("a", prompt=64))
    got = forecast([LinkView(load, slots=4, free_credits=3)], [], ticket("t", prompt=32))
    assert got is not None and got.ttft_s == pytest.approx(0.1 * (1 + 3))


def test_a_full_link_frees_its_slot_when_the_shortest_request_ends() -> None:
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, max_running=2, prefill_budget=64)), 0.0)
    for name in ("a", "b"):
        load.sent(submission(name, new=10))
    progress(load, "a", 6)  # 4 tokens left
    progress(load, "b", 1)  # 9 left
    view = LinkView(load, slots=load.slots(credit_limit=2), free_credits=0)
    got = forecast([view], [], ticket("t"))
    assert got is not None and got.start_s == pytest.approx(0.4)
    assert got.ttft_s == pytest.approx(0.4 + 0.1 * 2)
    # One ticket ahead takes a's slot; the next one frees when b ends.
    behind = forecast([view], [ticket("first")], ticket("t"))
    assert behind is not None and behind.start_s == pytest.approx(0.9)
    # Two ahead: the second waits for the first's whole run in a's slot (1 chunk + 10 tokens).
    far = forecast([view], [ticket("first"), ticket("second")], ticket("t"))
    assert far is not None and far.start_s == pytest.approx(0.4 + 1.1)


def test_finished_and_rejected_requests_free_their_slots() -> None:
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, max_running=2)), 0.0)
    load.sent(submission("a"))
    load.sent(submission("b"))
    assert load.open_requests == 2
    progress(load, "a", 10, finished=True)
    load.observe(worker_pb2.ConnectResponse(rejections=[worker_pb2.Rejection(request_id="b")]), 0.0)
    assert load.open_requests == 0
    got = forecast([LinkView(load, slots=2, free_credits=2)], [], ticket("t"))
    assert got is not None and got.start_s == 0.0


def test_requests_queued_inside_a_worker_wait_for_that_workers_slots() -> None:
    slow, fast = LinkLoad(), LinkLoad()
    slow.observe(worker_pb2.ConnectResponse(step=step(100.0, max_running=1)), 0.0)
    fast.observe(worker_pb2.ConnectResponse(step=step(100.0, max_running=1)), 0.0)
    for name in ("running", "queued"):
        slow.sent(submission(name, new=10))
    progress(slow, "running", 5)
    fast.sent(submission("other", new=10))
    progress(fast, "other", 2)
    views = [LinkView(slow, slots=1, free_credits=0), LinkView(fast, slots=1, free_credits=0)]
    got = forecast(views, [], ticket("t"))
    # slow's slot goes to its own queued request; the ticket gets fast's at 8 steps.
    assert got is not None and got.start_s == pytest.approx(0.8)


def test_a_continuation_counts_its_prior_tokens() -> None:
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, max_running=1)), 0.0)
    load.sent(submission("resumed", prompt=8, new=10, prior=7))
    progress(load, "resumed", 8)
    got = forecast([LinkView(load, slots=1, free_credits=0)], [], ticket("t"))
    assert got is not None and got.start_s == pytest.approx(0.2)
    load.clear()
    assert load.open_requests == 0


def test_slots_granted_but_not_sent_yet_count_by_their_own_sizes() -> None:
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, max_running=2, prefill_budget=64)), 0.0)
    # Both credits granted to longer requests still being tokenized: the next one waits for the
    # shorter of them, not for one of its own size.
    view = LinkView(load, slots=2, free_credits=0, unsent=[ticket("a", new=30), ticket("b", new=40)])
    got = forecast([view], [], ticket("t", new=10))
    assert got is not None and got.start_s == pytest.approx(0.1 * (30 + 1))


def test_a_busy_engines_step_time_is_its_cadence_between_reports() -> None:
    """Two reports 0.5 s apart, two steps apart, of 100 ms forward passes: a request waits 0.25 s a
    step. After an idle engine the gap says nothing, and the step's own duration counts."""
    load = LinkLoad()

    def report(number: int, at: float, *, running: int) -> None:
        info = step(100.0)
        info.step, info.running = number, running
        load.observe(worker_pb2.ConnectResponse(step=info), at)

    report(10, 0.0, running=4)
    assert load.step_s == pytest.approx(0.1)
    report(12, 0.5, running=4)
    assert load.step_s == pytest.approx(0.1 + 0.3 * (0.25 - 0.1))
    before = load.step_s or 0.0
    report(13, 0.6, running=0)  # the cadence here is 0.1 s, the step's duration
    assert load.step_s == pytest.approx(before + 0.3 * (0.1 - before))
    after_busy = load.step_s or 0.0
    report(14, 30.0, running=1)  # the engine was idle since step 13
    assert load.step_s == pytest.approx(after_busy + 0.3 * (0.1 - after_busy))


def test_tickets_that_start_together_share_the_prefill_of_the_steps_that_follow() -> None:
    """Four slots free at the same step; four tickets ahead take them, so the ticket starts one request
    later; two of its own kind starting together in one slot's place would split the prefill budget."""
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, max_running=4, prefill_budget=64)), 0.0)
    for name in "abcd":
        load.sent(submission(name, new=10))
        progress(load, name, 7)  # 3 tokens left each: all four slots free at 0.3 s
    view = LinkView(load, slots=4, free_credits=0)
    alone = forecast([view], [], ticket("t", prompt=32))
    assert alone is not None and alone.start_s == pytest.approx(0.3)
    assert alone.ttft_s == pytest.approx(0.3 + 0.1 * (1 + 1))
    # Three tickets ahead start at 0.3 s too: 4 x 32 prompt tokens at 64 a step take 2 chunks.
    shared = forecast([view], [ticket(f"a{i}") for i in range(3)], ticket("t", prompt=32))
    assert shared is not None and shared.start_s == pytest.approx(0.3)
    assert shared.ttft_s == pytest.approx(0.3 + 0.1 * (1 + 2))


def test_the_margin_is_how_late_recent_first_tokens_came_against_their_forecast() -> None:
    """The forecast adds the 95th percentile of the link's recent lateness: none before 20 samples,
    nothing for early ones, and it leaves as the late ones age out of the window."""
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, prefill_budget=64)), 0.0)

    def first_tokens(count: int, late_s: float, start: int = 0) -> None:
        for i in range(start, start + count):
            load.sent(submission(f"r{i}"), due=10.0)
            load.observe(
                worker_pb2.ConnectResponse(
                    updates=[worker_pb2.TokenUpdate(request_id=f"r{i}", output_tokens=1)]
                ),
                10.0 + late_s,
            )
            load.forget(f"r{i}")

    first_tokens(19, 0.5)
    assert load.margin_s == 0.0  # too few to say
    first_tokens(1, 0.5, start=19)
    assert load.margin_s == pytest.approx(0.5)
    got = forecast([LinkView(load, slots=4, free_credits=4)], [], ticket("t"))
    assert got is not None and got.margin_s == pytest.approx(0.5)
    assert got.ttft_s == pytest.approx(0.1 * 2 + 0.5)
    first_tokens(200, -0.3, start=20)  # on time and early: the late ones left the window
    assert load.margin_s == 0.0
    load.sent(submission("untimed"))  # no forecast: nothing to learn from
    load.observe(
        worker_pb2.ConnectResponse(updates=[worker_pb2.TokenUpdate(request_id="untimed", output_tokens=1)]),
        99.0,
    )
    assert load.margin_s == 0.0


def fitted_load(fixed_ms: float, per_decode_ms: float, per_token_ms: float, budget: int) -> LinkLoad:
    """A LinkLoad whose worker reported 24 idle steps of varied batches, timed by the given model."""
    load = LinkLoad()
    for i in range(24):
        decodes, prefill = 2 + i % 4, 64 * (i % 3)
        duration = fixed_ms + per_decode_ms * decodes + per_token_ms * prefill
        info = worker_pb2.StepInfo(
            step=i + 1,
            duration_ms=duration,
            decodes=decodes,
            prefill_tokens=prefill,
            running=0,
            max_running=8,
            prefill_budget=budget,
        )
        load.observe(worker_pb2.ConnectResponse(step=info), float(i))
    return load


def test_prefill_chunks_are_priced_by_the_step_time_model_once_fitted() -> None:
    """A 512-token prompt ahead costs its tokens' time, not a short average step per chunk."""
    load = fitted_load(20.0, 3.0, 1.0, budget=256)
    load.sent(submission("long", prompt=512))
    got = forecast([LinkView(load, slots=8, free_credits=7)], [], ticket("t", prompt=32))
    assert got is not None
    # The step in progress (the average step), then ceil(544 / 256) = 3 chunks of 20 ms fixed and
    # 544 prefill tokens at 1 ms (the last step reported 0 running, so no decode cost).
    assert got.ttft_s == pytest.approx((load.step_s or 0) + 3 * 0.020 + 0.544)
    assert got.priced


def test_a_forecast_before_the_model_is_fitted_is_cold_and_not_priced() -> None:
    """A cold forecast (the average step per chunk) is marked, so the margin never learns from it."""
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, prefill_budget=16)), 0.0)
    got = forecast([LinkView(load, slots=4, free_credits=4)], [], ticket("t", prompt=40))
    assert got is not None and not got.priced


def test_a_favoured_ticket_does_not_wait_for_prompts_of_a_lower_worker_priority() -> None:
    load = fitted_load(20.0, 3.0, 1.0, budget=256)
    load.sent(submission("noisy", prompt=512), tenant="noisy")
    behind = forecast([LinkView(load, slots=8, free_credits=7, priority=0)], [], ticket("t", prompt=32))
    ahead = forecast([LinkView(load, slots=8, free_credits=7, priority=1)], [], ticket("t", prompt=32))
    assert behind is not None and ahead is not None
    assert ahead.ttft_s == pytest.approx((load.step_s or 0) + 0.020 + 0.032)
    assert behind.ttft_s > ahead.ttft_s + 0.5


def test_a_favoured_ticket_takes_a_running_slot_of_a_lower_priority_at_once() -> None:
    """Every slot is held by a running request of worker priority 0, and one more waits inside the
    worker: a ticket of priority 0 waits for the first to end and behind the queued one, one of
    priority 1 with a credit starts at once (the worker preempts one of them for it) and passes the
    queued one; without a credit it starts once the first request ends."""
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, max_running=2, prefill_budget=64)), 0.0)
    for name in ("a", "b", "queued"):
        load.sent(submission(name, new=10))
    progress(load, "a", 6)
    progress(load, "b", 1)
    plain = forecast([LinkView(load, slots=2, free_credits=1, priority=0)], [], ticket("t"))
    assert plain is not None and plain.start_s == pytest.approx(0.9)  # a's slot goes to "queued"
    favoured = forecast([LinkView(load, slots=2, free_credits=1, priority=1)], [], ticket("t"))
    assert favoured is not None and favoured.start_s == 0.0
    assert favoured.ttft_s == pytest.approx(0.1 * 2)
    # Without a credit it may take, it reaches the worker when the first request ends (a, at 0.4).
    no_credit = forecast([LinkView(load, slots=2, free_credits=0, priority=1)], [], ticket("t"))
    assert no_credit is not None and no_credit.start_s == pytest.approx(0.4)


def test_reported_prefill_is_credited_to_the_prompts_in_the_order_the_worker_takes_them() -> None:
    """A step that computed 400 prompt tokens leaves 112 of a 512-token prompt sent first to wait for,
    and all of a later one; a favoured prompt sent later is credited first."""
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0, max_running=8, prefill_budget=128)), 0.0)
    load.sent(submission("first", prompt=512))
    load.sent(submission("second", prompt=256))
    info = worker_pb2.StepInfo(
        step=2, duration_ms=100.0, prefill_tokens=400, max_running=8, prefill_budget=128
    )
    load.observe(worker_pb2.ConnectResponse(step=info), 0.1)
    _, _, pending = load.busy_until(8)
    assert pending == 112 + 256
    favoured = submission("favoured", prompt=64)
    favoured.priority = 1
    load.sent(favoured)
    info = worker_pb2.StepInfo(
        step=3, duration_ms=100.0, prefill_tokens=100, max_running=8, prefill_budget=128
    )
    load.observe(worker_pb2.ConnectResponse(step=info), 0.2)
    _, _, pending = load.busy_until(8)
    assert pending == (112 - 36) + 256
    _, _, ahead_of_favoured = load.busy_until(8, priority=1)
    assert ahead_of_favoured == 0


def test_lateness_leaves_the_margin_after_a_while_even_with_no_request_admitted() -> None:
    """Only admitted requests teach the margin: one learnt in a bad moment would refuse every request
    after it and never hear otherwise, so its samples count for MARGIN_AGE_S seconds of worker messages."""
    load = LinkLoad()
    load.observe(worker_pb2.ConnectResponse(step=step(100.0)), 0.0)
    for i in range(MARGIN_MIN_SAMPLES):
        load.sent(submission(f"r{i}"), due=1.0)
        update = worker_pb2.TokenUpdate(request_id=f"r{i}", token_ids=[1], output_tokens=1)
        load.observe(worker_pb2.ConnectResponse(updates=[update]), 3.0)  # each 2 s late
    assert load.margin_s == pytest.approx(2.0)
    load.observe(worker_pb2.ConnectResponse(step=step(100.0)), 3.0 + MARGIN_AGE_S / 2)
    assert load.margin_s == pytest.approx(2.0)  # still lately
    load.observe(worker_pb2.ConnectResponse(step=step(100.0)), 3.0 + MARGIN_AGE_S + 0.1)
    assert load.margin_s == 0.0
