"""Scenario 11: a chaos soak: open-loop load through the SDK while faults hit every service in turn.

A stack started and supervised by the launcher (start_stack) takes a seeded open-loop load through
the client SDK (chaos_load.py): unary and streaming calls of mixed lengths, some cancelled by the
client, some with short deadlines, most greedy with ignore_eos so their tokens can be checked, a few
sampled. Meanwhile a seeded fault injector (chaos_injector.py) hits, one at a time, the primary
worker, the fallback worker and the tokenizer with kill -9, SIGSTOP then SIGCONT, and SIGTERM, and
the gateway with kill -9, waiting after each fault until the stack is fully serving again.

What must hold:
- every completed greedy answer's tokens are right (chaos_tokens.py): before `failover_at_token`
  the primary's greedy output for the prompt, after it the serving model's greedy continuation of
  prompt plus those tokens, all references computed in this process with the engine on the prompt
  ids the tokenizer service gave; a flip at a near tie (tests/parity.py's rule) is excused and
  counted, and the rest of its part compared with the greedy continuation of the answer's own tokens,
  so every token is compared (the run reports how many were not: 0). Both runs' models have greedy
  output that does not depend on their batch: float32, and in the full run the int8 fallback on
  int8-weight-only (chaos_configs.py); torch's dynamic int8, the product's fallback, would not be
  checkable so and is refused. Faults a failover could cause (a repeated, dropped or replaced token,
  a tail from a context one token short) are injected into the run's right failed-over answers:
  the check must catch every one;
- every failed request ends UNAVAILABLE, RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED (or is one the
  client cancelled), never INTERNAL or UNKNOWN, and none ends more than LATE_BOUND_S past its deadline;
- the SDK's retries turn failures before the first token into successes (counted; at least one);
- after every fault the stack is fully serving again (every service SERVING, every worker linked)
  within 10 s plus the slowest start measured in the run (a restarted process to SERVING, under the
  load); the supervisor, ticked here as `strata up` ticks it, restarts each service exactly once per
  kill -9 or SIGTERM and gives none up;
- afterwards each worker's running, waiting and open requests, KV blocks, free KV tokens and offered
  credits, and the gateway's queues, are exactly their values before the load;
- no process grows in resident memory from its warm baseline to its last sample by more than 5%
  in the full run, 10% in the short one: the baseline is taken `warm_s` after the process began
  serving (the load's start for the first processes, its SERVING for a restarted one), 60 s in the
  full run and 8 s in the short one, whose processes live shorter; a process that did not live that
  long is not judged. The short run's processes are small (a tiny model's gateway holds about 60 MiB)
  and 8 s of warm-up is short: there the gateway grew by 0, 0, 2.6 and 3.5% (2 MiB) in four runs.

Full (STRATA_RELIABILITY_FULL=1, `make chaos`): configs/local.yaml's stack (SmolLM2-135M-Instruct and
its int8 fallback on the CPU, int8-weight-only), 8 minutes of load, 18 faults. Short (CI): tiny random-weight
models (a test-mode step delay keeps streams running long enough to be hit), about 60 s of load and
10 faults.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from strata.cli.launcher import start_stack
from strata.cli.stack_config import route_options, worker_settings
from strata.retry import RetryPolicy
from tests.parity import TIE_GAP
from tests.reliability.chaos_configs import BATCH_DEPENDENT, full_config, tiny_config
from tests.reliability.chaos_faults import INJECTED, inject
from tests.reliability.chaos_injector import run_supervised
from tests.reliability.chaos_load import CLIENT_CANCELLED, OK
from tests.reliability.chaos_plan import (
    FALLBACK,
    GATEWAY,
    PRIMARY,
    TOKENIZER,
    FaultKind,
    LoadMix,
    fault_schedule,
    percentile,
    prompts,
)
from tests.reliability.chaos_soak import rss_growth, run_soak
from tests.reliability.chaos_tokens import Answer, Reference, Rule, check_answers

if TYPE_CHECKING:
    from pathlib import Path

    from tests.figures import Figure
    from tests.reliability.chaos_load import Outcome
    from tests.reliability.chaos_plan import Fault

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

SCENARIO = 11
RETRYABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"})
LATE_BOUND_S = 1.0
RECOVERY_MARGIN_S = 10.0
RETRY = RetryPolicy(max_attempts=6, initial_backoff_s=0.25, max_backoff_s=2.0)
"""Up to about 6 s of retries: long enough to span a gateway's or tokenizer's restart."""
WORDS = ("the", "river", "stone", "quick", "lamp", "over", "a", "garden", "seven", "north", "bright")


@dataclass(frozen=True)
class Version:
    seed: int
    faults: int
    gateway_kills: int
    pause_s: tuple[float, float]
    stopped_s: tuple[float, float]
    mix: LoadMix
    prompt_words: tuple[int, int]
    warm_s: float
    rss_bound: float


SHORT = Version(
    seed=11,
    faults=9,
    gateway_kills=1,
    pause_s=(0.5, 1.0),
    stopped_s=(1.0, 2.5),
    mix=LoadMix(
        rate_rps=10, span_s=60, prompts=24, new_tokens=(4, 40), timeout_s=20, short_deadline_s=(0.2, 1)
    ),
    prompt_words=(1, 16),
    warm_s=8,
    rss_bound=0.10,
)
FULL = Version(
    seed=11,
    faults=15,
    gateway_kills=3,
    pause_s=(4.0, 12.0),
    stopped_s=(2.0, 6.0),
    mix=LoadMix(
        rate_rps=2.5, span_s=480, prompts=40, new_tokens=(8, 64), timeout_s=60, short_deadline_s=(0.5, 3)
    ),
    prompt_words=(3, 60),
    warm_s=60,
    rss_bound=0.05,
)


@pytest.fixture
def chaos_config(request: pytest.FixtureRequest, full: bool, tmp_path: Path) -> Path:
    if full:
        request.getfixturevalue("real_model_dir")
        return full_config(tmp_path / "stack.yaml")
    primary = request.getfixturevalue("tiny_serving_dir")
    return tiny_config(tmp_path / "stack.yaml", primary, request.getfixturevalue("tiny_fallback_dir"))


def fault_schedule_of(version: Version) -> list[Fault]:
    return fault_schedule(
        version.seed,
        version.faults,
        gateway_kills=version.gateway_kills,
        pause_s=version.pause_s,
        stopped_s=version.stopped_s,
    )


def test_chaos_soak_keeps_answers_right_and_the_stack_recovers(
    chaos_config: Path, tmp_path: Path, full: bool, figure: Figure
) -> None:
    version = FULL if full else SHORT
    settings = worker_settings(chaos_config)
    primary = settings[0].model_name
    fallback = next(str(r["fallback"]) for r in route_options(chaos_config) if r["model"] == primary)
    models = tuple(w.model_name for w in settings)
    roles = {PRIMARY: "worker 0", FALLBACK: f"worker {models.index(fallback)}", TOKENIZER: "tokenizer"}
    roles[GATEWAY] = "gateway"
    texts = prompts(version.seed, version.mix.prompts, version.prompt_words, WORDS)
    faults = fault_schedule_of(version)
    # configs/local.yaml's gateway listens on the default ports; the soak's takes free ones.
    env = (
        {"STRATA_GATEWAY_LISTEN": "127.0.0.1:0", "STRATA_GATEWAY_HTTP_LISTEN": "127.0.0.1:0"} if full else {}
    )
    started = time.monotonic()
    with start_stack(chaos_config, env=env, log_dir=tmp_path / "logs", ready_timeout_s=900) as stack:
        stack_start_s = time.monotonic() - started
        cap_s = 5 * (RECOVERY_MARGIN_S + stack_start_s)
        load = (version.seed, version.mix, RETRY)
        soak, supervision = run_supervised(
            stack,
            lambda: run_soak(stack, roles, texts, faults, load, version.warm_s, cap_s),
            timeout_s=10 * version.mix.span_s + len(faults) * cap_s,
        )
    outcomes, records = soak.outcomes, soak.records

    by_code = Counter(o.code for o in outcomes)
    answers = [
        Answer(soak.prompt_ids[o.planned.prompt], o.tokens, o.planned.max_new_tokens, o.failover_at, o.model)
        for o in outcomes
        if o.code == OK and o.planned.checked
    ]
    served = [w for w in settings if w.model_name in (primary, fallback)]
    assert not [w.model_name for w in served if w.quantization in BATCH_DEPENDENT], "not checkable exactly"
    references = {w.model_name: Reference(w) for w in served}
    rules = {w.model_name: Rule(tie_gap=TIE_GAP) for w in served}
    checked = check_answers(answers, references, primary, fallback, rules)
    right_failovers = [a for i, a in enumerate(answers) if a.failover_at and i not in checked.failed]
    injected = inject(right_failovers, references[fallback], TIE_GAP)
    caught = check_answers([a for _, _, a in injected], references, primary, fallback, rules).failed
    caught_by_kind = Counter(injected[i][0] for i in caught)
    injected_by_kind = Counter(kind for kind, _, _ in injected)
    retried_ok = [o for o in outcomes if o.code == OK and o.attempts > 1]
    restarts = Counter(service for service, _ in supervision.restarts)
    expected_restarts = Counter(r.service for r in records if r.fault.kind is not FaultKind.STOP)
    slowest = max((s for starts in supervision.starts.values() for s in starts), default=stack_start_s)
    bound_s = RECOVERY_MARGIN_S + slowest

    figure(SCENARIO, "requests offered", len(outcomes), f"in {soak.seconds:.0f} s, seed {version.seed}")
    figure(SCENARIO, "completed", by_code[OK], f"({by_code[CLIENT_CANCELLED]} more cancelled by the client)")
    failed = {code: n for code, n in by_code.items() if code not in (OK, CLIENT_CANCELLED)}
    figure(SCENARIO, "failed by code", ", ".join(f"{c} {n}" for c, n in sorted(failed.items())) or "none")
    figure(
        SCENARIO,
        "failovers mid-stream (completed)",
        sum(1 for o in outcomes if o.code == OK and o.failover_at),
    )
    figure(
        SCENARIO,
        "completed on the fallback",
        sum(1 for o in outcomes if o.code == OK and o.model == fallback),
    )
    figure(SCENARIO, "greedy answers checked", len(answers), f"exact {checked.exact}")
    figure(SCENARIO, "tokens compared with a reference", checked.tokens_checked)
    unverified = f"tokens ({checked.answers_unverified} answers)"
    figure(SCENARIO, "tokens not compared (unverified)", checked.tokens_unverified, unverified)
    figure(SCENARIO, "near-tie flips excused (parity rule)", len(checked.excused))
    figure(SCENARIO, "answers with wrong tokens", len(checked.failures))
    shown = ", ".join(f"{k} {caught_by_kind[k]}/{injected_by_kind[k]}" for k in INJECTED)
    figure(SCENARIO, "injected failover faults caught", f"{len(caught)} of {len(injected)}", f"({shown})")
    figure(
        SCENARIO, "succeeded after SDK retries", len(retried_ok), f"({RETRY.max_attempts} attempts at most)"
    )
    late = max(o.late_s for o in outcomes)
    figure(SCENARIO, "latest end past a deadline", late, "s")
    figure(SCENARIO, "faults", len(records), f"of {len(faults)} planned")
    for service in sorted(roles.values()):
        causes = Counter(c for s, c in supervision.restarts if s == service)
        shown = ", ".join(f"{c} {n}" for c, n in sorted(causes.items()))
        figure(SCENARIO, f"restarts: {service}", restarts[service], f"({shown})" if shown else "")
    for service, starts in sorted(supervision.starts.items()):
        figure(
            SCENARIO,
            f"start after a restart: {service}",
            f"p50 {percentile(starts, 0.5):.2f} s, max {max(starts):.2f} s",
        )
    for label in sorted({r.fault.label for r in records}):
        times = [r.recovered_s for r in records if r.fault.label == label and r.recovered_s is not None]
        if times:
            shown = f"p50 {percentile(times, 0.5):.2f} s, max {max(times):.2f} s over {len(times)}"
            figure(SCENARIO, f"fully serving after {label}", shown, f"(bound {bound_s:.1f} s)")
    same = soak.idle_after == soak.idle_before
    figure(
        SCENARIO, "idle state back exactly", "yes" if same else "no", f"(settled in {soak.settled_s:.2f} s)"
    )
    growth = rss_growth(soak.sampler, version.warm_s, supervision.serving_since, soak.load_start)
    for service, (worst, count) in sorted(growth.items()):
        figure(
            SCENARIO,
            f"RSS growth after {version.warm_s:.0f} s warm: {service}",
            worst * 100,
            f"% max of {count}",
        )

    assert len(records) == len(faults), f"only {len(records)} of {len(faults)} faults were carried out"
    slow = [
        (r.fault.label, r.recovered_s) for r in records if r.recovered_s is None or r.recovered_s > bound_s
    ]
    assert not slow, f"not fully serving within {bound_s:.1f} s after: {slow}"
    assert soak.serving_after and not supervision.given_up, supervision.reports[-5:]
    assert soak.idle_after == soak.idle_before
    assert not checked.failures, "\n".join(checked.failures[:10])
    assert checked.tokens_unverified == 0 and checked.answers_unverified == 0
    assert injected and len(caught) == len(injected), f"caught {caught_by_kind} of {injected_by_kind}"
    bad = [(o.planned.request_id, o.code, o.details) for o in outcomes if not _allowed(o)]
    assert not bad, f"{len(bad)} requests ended with a status they must not: {bad[:10]}"
    assert late <= LATE_BOUND_S
    assert retried_ok, "no failure before the first token was turned into a success by the SDK's retries"
    assert all(o.streamed == o.tokens for o in outcomes if o.code == OK and o.planned.stream)
    assert {s: restarts[s] for s in roles.values()} == {s: expected_restarts[s] for s in roles.values()}
    grown = {service: worst for service, (worst, _) in growth.items() if worst > version.rss_bound}
    assert not grown, f"RSS grew more than {version.rss_bound:.0%} after the warm-up: {grown}"


def _allowed(outcome: Outcome) -> bool:
    if outcome.code == OK:
        return True
    if outcome.code == CLIENT_CANCELLED:
        return bool(outcome.planned.cancel_after)
    return outcome.code in RETRYABLE
