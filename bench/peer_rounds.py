"""bench.peer's rounds: contestants alternated, the machine's load read per round, loaded rounds repeated.

A round runs every contestant once, in an order that flips every round (rule 7 of bench/README.md).
The round's start is judged by the 1-minute load average against a threshold of QUIET_LOAD plus the
load our own earlier runs still leave in that average: Linux's average is an exponential one with
a 60 s time constant, so a run that kept `threads` runnable for d seconds and ended g seconds ago
still adds threads * (1 - e^(-d/60)) * e^(-g/60). Anything above that is someone else's work
competing for the cores. A round that starts above the threshold is run again after a bounded wait
for the load to settle, at most `max_repeats` times; the last attempt is kept, flagged when it too
started loaded, and every discarded attempt stays in the record, its load and its results. A
`repeat_budget_s` bounds the time all repeats of a run may take together: a repeat that the last
attempt's duration says would overrun it is not started, and the round is kept flagged. This module owns
the order, the threshold and the repeats; it must not start a contestant itself (bench/peer.py
passes `run_one`) nor summarize.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

# A 2-core machine with nothing but the OS running reads 0.0-0.3; above 0.5 someone else computes.
QUIET_LOAD = 0.5
LOAD_TIME_CONSTANT_S = 60.0
DEFAULT_MAX_REPEATS = 2
DEFAULT_SETTLE_S = 60.0
SETTLE_POLL_S = 5.0


@dataclass(frozen=True, slots=True)
class Busy:
    """One of our runs: when it kept `threads` threads runnable."""

    start: float
    end: float
    threads: int


def own_load(history: list[Busy], now: float) -> float:
    """What our own runs in `history` still contribute to the 1-minute load average at `now`."""
    total = 0.0
    for run in history:
        kept = 1.0 - math.exp(-(run.end - run.start) / LOAD_TIME_CONSTANT_S)
        total += run.threads * kept * math.exp(-max(0.0, now - run.end) / LOAD_TIME_CONSTANT_S)
    return total


def threshold(history: list[Busy], now: float) -> float:
    return QUIET_LOAD + own_load(history, now)


def wait_quiet(limit: Callable[[], float], timeout_s: float, clock: Clock | None = None) -> bool:
    """Wait, at most timeout_s, for the 1-minute load average to fall to `limit()`; whether it did."""
    clock = clock or Clock()
    deadline = clock.now() + timeout_s
    while clock.load()[0] > limit():
        if clock.now() >= deadline:
            return False
        clock.pause(min(SETTLE_POLL_S, max(0.0, deadline - clock.now())))
    return True


def order(contestants: list[str], index: int) -> list[str]:
    """The contestants in round `index`'s order: as given on even rounds, reversed on odd ones."""
    return contestants if index % 2 == 0 else contestants[::-1]


@dataclass(slots=True)
class Clock:
    """The time, the load average and a pause: the real ones by default."""

    now: Callable[[], float] = time.monotonic
    load: Callable[[], tuple[float, float, float]] = os.getloadavg
    pause: Callable[[float], None] = time.sleep


@dataclass(slots=True)
class Rounds:
    """Runs rounds of `contestants` through `run_one(name) -> result`, remembering our own load."""

    contestants: list[str]
    run_one: Callable[[str], dict[str, Any]]
    threads: int
    max_repeats: int = DEFAULT_MAX_REPEATS
    settle_s: float = DEFAULT_SETTLE_S
    repeat_budget_s: float | None = None
    clock: Clock = field(default_factory=Clock)
    history: list[Busy] = field(default_factory=list)
    repeat_seconds: float = 0.0

    def settle(self) -> None:
        """Wait, at most settle_s, for the load to fall to the threshold."""
        wait_quiet(lambda: threshold(self.history, self.clock.now()), self.settle_s, self.clock)

    def attempt(self, index: int) -> dict[str, Any]:
        start_load = list(self.clock.load())
        began_attempt = self.clock.now()
        limit = threshold(self.history, began_attempt)
        runs: dict[str, Any] = {}
        for name in order(self.contestants, index):
            began, load = self.clock.now(), self.clock.load()[0]
            result = self.run_one(name)
            ended = self.clock.now()
            self.history.append(Busy(began, ended, self.threads))
            runs[name] = {"result": result, "load_1m_start": load, "load_1m_end": self.clock.load()[0]}
        return {
            "load_average_start": start_load,
            "load_average_end": list(self.clock.load()),
            "threshold": limit,
            "loaded": start_load[0] > limit,
            "seconds": self.clock.now() - began_attempt,
            "runs": runs,
        }

    def _may_repeat(self, last: dict[str, Any]) -> bool:
        budget = self.repeat_budget_s
        return budget is None or self.repeat_seconds + self.settle_s + last["seconds"] <= budget

    def round(self, index: int) -> dict[str, Any]:
        """One round, repeated while its start was loaded (at most max_repeats times, within the
        repeat budget)."""
        attempts = [self.attempt(index)]
        while attempts[-1]["loaded"] and len(attempts) <= self.max_repeats and self._may_repeat(attempts[-1]):
            began = self.clock.now()
            self.settle()
            attempts.append(self.attempt(index))
            self.repeat_seconds += self.clock.now() - began
        kept = attempts[-1]
        return {"round": index + 1, **kept, "flagged": kept["loaded"], "discarded_attempts": attempts[:-1]}
