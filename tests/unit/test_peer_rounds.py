"""bench.peer_rounds: the load threshold, the flipped order and the bounded repeats of loaded rounds.

The clock and the load average are scripted (a round's contestants only record that they ran), so
each case says exactly which load each attempt started at and what the round must keep.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.peer_rounds import QUIET_LOAD, Busy, Clock, Rounds, order, own_load, threshold, wait_quiet


def test_own_load_is_what_our_runs_leave_in_the_one_minute_average() -> None:
    # Two threads for 60 s, just ended: 2 * (1 - 1/e); a minute later that has decayed by 1/e again.
    run = [Busy(0.0, 60.0, 2)]
    assert own_load(run, 60.0) == pytest.approx(2 * (1 - math.exp(-1)))
    assert own_load(run, 120.0) == pytest.approx(2 * (1 - math.exp(-1)) * math.exp(-1))
    assert own_load([], 5.0) == 0.0
    assert threshold(run, 60.0) == pytest.approx(QUIET_LOAD + own_load(run, 60.0))


def test_rounds_alternate_and_flip() -> None:
    names = ["llama", "engine", "llama-q8"]
    assert order(names, 0) == names
    assert order(names, 1) == names[::-1]
    assert order(names, 2) == names


class Script:
    """Time advances 10 s per run; the load reads from a list, one value per attempt's start."""

    def __init__(self, starts: list[float]) -> None:
        self.time = 0.0
        self.starts = starts
        self.reading = starts[0]
        self.ran: list[str] = []
        self.paused = 0.0

    def clock(self) -> Clock:
        return Clock(lambda: self.time, lambda: (self.reading, 0.0, 0.0), self.pause)

    def pause(self, seconds: float) -> None:
        self.paused += seconds
        self.time += seconds

    def run_one(self, name: str) -> dict[str, Any]:
        self.ran.append(name)
        self.time += 10.0
        return {"1": {"tok_s": 1.0}}


def _rounds(script: Script, max_repeats: int = 2) -> Rounds:
    return Rounds(
        ["a", "b"], script.run_one, threads=2, max_repeats=max_repeats, settle_s=0.0, clock=script.clock()
    )


def test_a_quiet_round_runs_once() -> None:
    script = Script([0.1])
    kept = _rounds(script).round(0)
    assert script.ran == ["a", "b"]
    assert not kept["flagged"] and kept["discarded_attempts"] == []
    assert kept["load_average_start"][0] == 0.1 and kept["threshold"] == QUIET_LOAD


def test_a_loaded_round_is_repeated_until_quiet_and_the_quiet_attempt_kept() -> None:
    script = Script([3.0])
    rounds = _rounds(script)

    def run_one(name: str) -> dict[str, Any]:
        result = Script.run_one(script, name)
        # Someone else's job ends during the first attempt.
        script.reading = 0.2
        return result

    rounds.run_one = run_one
    kept = rounds.round(1)
    assert script.ran == ["b", "a", "b", "a"]
    assert len(kept["discarded_attempts"]) == 1 and kept["discarded_attempts"][0]["loaded"]
    assert kept["discarded_attempts"][0]["runs"]["b"]["load_1m_start"] == 3.0
    assert not kept["flagged"] and kept["round"] == 2


def test_a_round_loaded_throughout_stops_after_max_repeats_and_is_flagged() -> None:
    script = Script([5.0])
    kept = _rounds(script, max_repeats=2).round(0)
    assert len(script.ran) == 6
    assert kept["flagged"] and len(kept["discarded_attempts"]) == 2


def test_our_own_previous_run_does_not_count_as_load() -> None:
    # A reading of 1.3 right after our own 2-thread, 20 s runs is ours, not a neighbour's.
    script = Script([0.1])
    rounds = _rounds(script)
    rounds.round(0)
    script.reading = QUIET_LOAD + own_load(rounds.history, script.time) - 0.01
    assert script.reading > 0.5
    kept = rounds.round(1)
    assert not kept["flagged"] and kept["discarded_attempts"] == []


def test_settling_waits_at_most_its_bound() -> None:
    script = Script([5.0])
    rounds = Rounds(["a"], script.run_one, threads=2, max_repeats=1, settle_s=30.0, clock=script.clock())
    kept = rounds.round(0)
    assert 30.0 <= script.paused <= 35.0
    assert kept["flagged"]


def test_the_repeat_budget_stops_repeats_that_would_overrun_it() -> None:
    # Each attempt takes 20 s (two 10 s runs): a 50 s budget allows two repeats in all, not three.
    script = Script([5.0])
    rounds = Rounds(
        ["a", "b"],
        script.run_one,
        threads=2,
        max_repeats=2,
        settle_s=0.0,
        repeat_budget_s=50.0,
        clock=script.clock(),
    )
    first = rounds.round(0)
    second = rounds.round(1)
    assert len(first["discarded_attempts"]) == 2 and first["flagged"]
    assert second["discarded_attempts"] == [] and second["flagged"]
    assert rounds.repeat_seconds == pytest.approx(40.0)


def test_waiting_for_quiet_returns_once_the_load_falls_and_gives_up_at_its_bound() -> None:
    # What bench.peer does after building the peer: the build's load decays while it waits.
    script = Script([3.3])
    decay = script.pause

    def decaying(seconds: float) -> None:
        decay(seconds)
        script.reading *= math.exp(-seconds / 60.0)

    clock = Clock(lambda: script.time, lambda: (script.reading, 0.0, 0.0), decaying)
    assert wait_quiet(lambda: QUIET_LOAD, 300.0, clock)
    assert script.reading <= QUIET_LOAD and script.paused == pytest.approx(115.0)
    script.reading = 3.3
    script.paused = 0.0
    assert not wait_quiet(lambda: QUIET_LOAD, 30.0, clock)
    assert script.paused == pytest.approx(30.0)
