"""The StageClock: a request's gateway time split into stages that never overlap and always sum up."""

from __future__ import annotations

import pytest

from gateway.stage_clock import Call, StageClock


def _ms(clock: StageClock) -> dict[str, float]:
    return {stage: round(value, 6) for stage, value in clock.milliseconds().items()}


def test_a_request_splits_into_its_stages_exactly() -> None:
    clock = StageClock(cursor=10.000)
    # The tokenize call starts 1 ms after arrival (waiting for a batch) and takes 4 ms, 3 on the server.
    clock.hop(Call(started=10.001, ended=10.005, server_ms=3.0), "preprocess", "tokenize")
    # Admitted 2 ms later; the worker reports 5 ms queue + 80 ms forward; the last update arrives at
    # 10.097 (so 10 ms of network), is detokenized in 1.5 ms (1 ms on the server), done at 10.099.
    clock.worker_attempt(
        submitted=10.007,
        ended=10.099,
        received=10.097,
        worker_queue_ms=5.0,
        worker_ms=85.0,
        detokenize=Call(started=10.0972, ended=10.0987, server_ms=1.0),
    )
    parts = _ms(clock)
    assert parts == pytest.approx(
        {
            "network": 1.0 + 5.0 + 0.5,
            "preprocess": 3.0,
            "queue": 1.0 + 2.0 + 5.0,
            "forward": 80.0,
            "decode": 1.5,
        }
    )
    assert sum(parts.values()) == pytest.approx(99.0)
    assert clock.cursor == 10.099


def test_segments_tile_the_gateway_side_and_halve_each_hops_network() -> None:
    clock = StageClock(cursor=0.0)
    clock.hop(Call(0.0, 0.010, server_ms=6.0), "preprocess", "tokenize")
    tokenize_network = [s for s in clock.segments if s.hop == "tokenize"]
    assert [(s.start, s.end) for s in tokenize_network] == [(0.0, 0.002), (0.008, 0.010)]
    clock.worker_attempt(
        submitted=0.020, ended=0.120, received=0.110, worker_queue_ms=0.0, worker_ms=70.0, detokenize=None
    )
    worker_network = [s for s in clock.segments if s.hop == "worker"]
    assert [t for s in worker_network for t in (s.start, s.end)] == pytest.approx(
        [0.020, 0.030, 0.100, 0.110]
    )
    queue = [s for s in clock.segments if s.stage == "queue"]
    assert [(s.start, s.end) for s in queue] == [(0.010, 0.020)]
    decode = [s for s in clock.segments if s.stage == "decode"]
    assert [(s.start, s.end) for s in decode] == [(0.110, 0.120)]
    # Gateway-side segments plus the remote parts (preprocess, worker time) give the whole.
    local = sum(s.end - s.start for s in clock.segments)
    remote = clock.parts["preprocess"] + clock.parts["forward"]
    assert local + remote == pytest.approx(0.120)


def test_a_worker_that_never_answered_is_all_network() -> None:
    clock = StageClock(cursor=1.0)
    clock.worker_attempt(
        submitted=1.5, ended=3.0, received=None, worker_queue_ms=0.0, worker_ms=0.0, detokenize=None
    )
    assert _ms(clock) == pytest.approx(
        {"network": 1500.0, "preprocess": 0.0, "queue": 500.0, "forward": 0.0, "decode": 0.0}
    )


def test_a_worker_reporting_more_than_the_gateway_saw_is_capped() -> None:
    """Clocks differ between processes: the worker's time never exceeds the interval that held it."""
    clock = StageClock(cursor=0.0)
    clock.worker_attempt(
        submitted=0.0, ended=0.051, received=0.050, worker_queue_ms=70.0, worker_ms=90.0, detokenize=None
    )
    parts = _ms(clock)
    assert parts["queue"] == pytest.approx(50.0) and parts["forward"] == 0.0 and parts["network"] == 0.0
    assert sum(parts.values()) == pytest.approx(51.0)


def test_time_never_runs_backwards() -> None:
    """A call that began before the cursor (a batch sent before the caller joined) starts at the cursor."""
    clock = StageClock(cursor=5.0)
    clock.hop(Call(started=4.9, ended=5.004, server_ms=50.0), "preprocess", "tokenize")
    assert sum(clock.parts.values()) == pytest.approx(0.004)
    assert clock.parts["preprocess"] == pytest.approx(0.004) and clock.parts["network"] == 0.0
    clock.wait("queue", 4.0)
    assert clock.cursor == 5.004
