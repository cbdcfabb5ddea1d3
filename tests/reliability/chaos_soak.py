"""One chaos soak on a started stack: the seeded load through the SDK and the fault schedule together,
with the stack's idle state before and after and its processes' resident memory.

`run_soak` is what the test's supervised thread runs (chaos_injector.run_supervised): it checks that
the stack serves, reads its idle state and the prompts' token ids (from the tokenizer service, as the
gateway tokenizes them), starts the RSS sampler and the injector, sends the load (chaos_load.py), waits
for the injector, and reads the idle state again until it is back (or 30 s have passed). `rss_growth`
judges each process's memory from a warm baseline after it began serving. This module must not
assert an outcome, beyond the stack serving at the start.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tests.polling import poll
from tests.reliability.chaos_injector import Injector
from tests.reliability.chaos_load import CountingClient, run_load
from tests.reliability.chaos_plan import load_plan
from tests.reliability.chaos_probes import RssSampler, fully_serving, idle_state
from tests.reliability.harness import prompt_ids

if TYPE_CHECKING:
    from collections.abc import Mapping

    from strata.cli.launcher import Stack
    from strata.retry import RetryPolicy
    from tests.reliability.chaos_injector import FaultRecord
    from tests.reliability.chaos_load import Outcome
    from tests.reliability.chaos_plan import Fault, LoadMix


@dataclass
class Soak:
    """What one soak measured while the stack ran."""

    outcomes: list[Outcome]
    records: list[FaultRecord]
    load_start: float
    """time.monotonic() when the load began."""
    seconds: float
    idle_before: dict[str, tuple[int, ...]]
    idle_after: dict[str, tuple[int, ...]]
    settled_s: float
    """Seconds until the idle state was back (30 s and more: it was not)."""
    serving_after: bool
    sampler: RssSampler
    prompt_ids: list[list[int]]


def run_soak(
    stack: Stack,
    roles: Mapping[str, str],
    texts: list[str],
    faults: list[Fault],
    load: tuple[int, LoadMix, RetryPolicy],
    warm_s: float,
    cap_s: float,
) -> Soak:
    """Faults and load on a started stack (while the caller supervises it), then its idle state.

    `load` is the load plan's seed, its mix and the clients' retry policy; the faults begin `warm_s`
    after the load; a fault not recovered from within `cap_s` ends the injection.
    """
    seed, mix, retry = load
    addresses, models, primary = stack.addresses, stack.worker_models, stack.worker_models[0]
    assert fully_serving(addresses)
    idle_before = idle_state(addresses, models)
    ids = [prompt_ids(addresses.tokenizer, text, model=primary) for text in texts]
    injector = Injector(
        roles,
        lambda: stack.pids,
        lambda: fully_serving(addresses),
        recovery_bound_s=cap_s,
        # Each fault may take up to its recovery bound on top of the load: on one core the restarts
        # after the faults, not the load, are what takes longest.
        deadline_s=5 * mix.span_s + len(faults) * cap_s,
    )
    sampler = RssSampler(lambda: stack.pids, interval_s=0.5)
    sampler.start()
    load_start = time.monotonic() + 1.0
    injector.start(faults, begin_at=load_start + warm_s)
    plan = load_plan(seed, mix)
    outcomes = asyncio.run(
        run_load(
            addresses.gateway, plan, texts, primary, lambda a: CountingClient(a, retry=retry), load_start
        )
    )
    injector.join(timeout_s=5 * mix.span_s + len(faults) * cap_s)
    seconds = time.monotonic() - load_start
    sampler.sample()
    sampler.stop()
    settling = time.monotonic()
    idle_after = poll(lambda: idle_state(addresses, models), 30, until=lambda state: state == idle_before)
    settled = time.monotonic() - settling
    return Soak(
        outcomes,
        injector.records,
        load_start,
        seconds,
        idle_before,
        idle_after,
        settled,
        fully_serving(addresses),
        sampler,
        ids,
    )


def rss_growth(
    sampler: RssSampler, warm_s: float, serving_since: dict[int, float], load_start: float
) -> dict[str, tuple[float, int]]:
    """Per service: the largest growth of any of its processes from `warm_s` after it began serving
    (the load's start for the first ones), and how many processes lived that long."""
    growth: dict[str, tuple[float, int]] = {}
    for series in sampler.series.values():
        value = series.growth(warm_s, serving_since.get(series.pid, load_start))
        if value is None:
            continue
        worst, count = growth.get(series.service, (float("-inf"), 0))
        growth[series.service] = (max(worst, value), count + 1)
    return growth
