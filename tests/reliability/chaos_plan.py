"""The chaos soak's plans, drawn from a seed: which fault hits which service when, and which requests
leave when, with what shape. Pure: no I/O, no clock, no processes.

`fault_schedule` gives every (target, fault) pair of the primary worker, the fallback worker and the
tokenizer at least once (kill -9, SIGSTOP then SIGCONT, SIGTERM), fills the rest of `count` with
random pairs, adds `gateway_kills` kill -9s of the gateway, and orders them so that no service is hit
twice in a row; each fault carries the pause before it and, for SIGSTOP, how long the process stays
stopped. `load_plan` draws open-loop (Poisson) arrivals over a span with a mix of unary and streaming
calls, prompt and output lengths, client cancels, short deadlines and seeded sampled requests; greedy
requests ignore EOS so that their tokens can be checked exactly. The same seed gives the same plans.
This module must not touch a process, a clock or the network: chaos_injector.py and chaos_load.py
carry the plans out.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

PRIMARY = "primary"
FALLBACK = "fallback"
TOKENIZER = "tokenizer"
GATEWAY = "gateway"
TARGETS = (PRIMARY, FALLBACK, TOKENIZER)
"""The services that get every kind of fault; the gateway gets kill -9 only."""


class FaultKind(enum.StrEnum):
    KILL = "kill -9"
    STOP = "SIGSTOP+SIGCONT"
    TERM = "SIGTERM"


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: `pause_s` after the stack recovered from the previous one, `kind` to `target`."""

    index: int
    target: str
    kind: FaultKind
    pause_s: float
    stopped_s: float = 0.0
    """For SIGSTOP: seconds between SIGSTOP and SIGCONT; 0 otherwise."""

    @property
    def label(self) -> str:
        return f"{self.kind} {self.target}"


def fault_schedule(
    seed: int,
    count: int,
    *,
    gateway_kills: int,
    pause_s: tuple[float, float],
    stopped_s: tuple[float, float],
) -> list[Fault]:
    """`count` faults on TARGETS (every pair at least once) plus `gateway_kills` gateway kill -9s.

    No two faults in a row hit the same service. Raises ValueError when `count` cannot cover every
    pair, or the gateway kills are too many to keep apart.
    """
    pairs = [(target, kind) for target in TARGETS for kind in FaultKind]
    if count < len(pairs):
        raise ValueError(f"count={count} cannot cover the {len(pairs)} (target, fault) pairs; use >= 9")
    if gateway_kills > count + 1:
        raise ValueError(f"gateway_kills={gateway_kills} cannot be kept apart by {count} other faults")
    rng = random.Random(seed)
    chosen = pairs + [rng.choice(pairs) for _ in range(count - len(pairs))]
    rng.shuffle(chosen)
    ordered = _apart(chosen, rng)
    # The gateway kills go into distinct gaps between the other faults, so never two in a row.
    gaps = sorted(rng.sample(range(len(ordered) + 1), gateway_kills), reverse=True)
    for gap in gaps:
        ordered.insert(gap, (GATEWAY, FaultKind.KILL))
    faults = []
    for index, (target, kind) in enumerate(ordered):
        stopped = rng.uniform(*stopped_s) if kind is FaultKind.STOP else 0.0
        faults.append(Fault(index, target, kind, rng.uniform(*pause_s), stopped))
    return faults


def _apart(pairs: list[tuple[str, FaultKind]], rng: random.Random) -> list[tuple[str, FaultKind]]:
    """The pairs reordered so that no target follows itself: always take from the most frequent
    target left that differs from the last one (ties broken by the seed)."""
    left = list(pairs)
    ordered: list[tuple[str, FaultKind]] = []
    while left:
        last = ordered[-1][0] if ordered else None
        counts = {t: sum(1 for p in left if p[0] == t) for t in {p[0] for p in left}}
        candidates = [t for t in counts if t != last] or list(counts)
        most = max(counts[t] for t in candidates)
        target = rng.choice(sorted(t for t in candidates if counts[t] == most))
        pick = next(i for i, p in enumerate(left) if p[0] == target)
        ordered.append(left.pop(pick))
    return ordered


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of the load: it leaves `at_s` seconds after the load starts, whatever happened before."""

    index: int
    at_s: float
    prompt: int
    """Index into the load's prompts."""
    stream: bool
    max_new_tokens: int
    timeout_s: float
    cancel_after: int = 0
    """A stream the client cancels once it has this many tokens; 0: not cancelled."""
    sampled: bool = False
    """Temperature sampling with a seed (its tokens are not checked); otherwise greedy with ignore_eos."""
    short_deadline: bool = False

    @property
    def request_id(self) -> str:
        return f"chaos-{self.index}"

    @property
    def checked(self) -> bool:
        """Whether a completed answer's tokens are checked against the references."""
        return not self.sampled


@dataclass(frozen=True, slots=True)
class LoadMix:
    """The shape of the load: rate and span, lengths, and the share of each special kind."""

    rate_rps: float
    span_s: float
    prompts: int
    new_tokens: tuple[int, int]
    timeout_s: float
    short_deadline_s: tuple[float, float]
    stream_share: float = 0.5
    cancel_share: float = 0.1
    deadline_share: float = 0.1
    sampled_share: float = 0.1
    max_requests: int = 100_000
    """A bound on the plan's length whatever the rate and span."""


def load_plan(seed: int, mix: LoadMix) -> list[Planned]:
    """Poisson arrivals at `mix.rate_rps` over `mix.span_s` (at most `mix.max_requests`)."""
    rng = random.Random(seed)
    plan: list[Planned] = []
    at = rng.expovariate(mix.rate_rps)
    while at < mix.span_s and len(plan) < mix.max_requests:
        roll = rng.random()
        cancel = roll < mix.cancel_share
        short = mix.cancel_share <= roll < mix.cancel_share + mix.deadline_share
        sampled = not cancel and not short and rng.random() < mix.sampled_share
        new_tokens = rng.randint(*mix.new_tokens)
        plan.append(
            Planned(
                index=len(plan),
                at_s=at,
                prompt=rng.randrange(mix.prompts),
                stream=cancel or rng.random() < mix.stream_share,
                max_new_tokens=new_tokens,
                timeout_s=rng.uniform(*mix.short_deadline_s) if short else mix.timeout_s,
                cancel_after=rng.randint(1, max(1, new_tokens // 2)) if cancel else 0,
                sampled=sampled,
                short_deadline=short,
            )
        )
        at += rng.expovariate(mix.rate_rps)
    return plan


def prompts(seed: int, count: int, words: tuple[int, int], vocabulary: tuple[str, ...]) -> list[str]:
    """`count` distinct prompts of random length (in words), each numbered so no two are equal."""
    rng = random.Random(seed)
    return [
        f"{i}: " + " ".join(rng.choice(vocabulary) for _ in range(rng.randint(*words))) for i in range(count)
    ]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between the nearest ranks; ValueError when empty."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
