"""What the options of `strata bench` default to and how they are checked, closed loop and open loop.

The two loads share one resolution: a `Mode` names its defaults (full and --smoke), the options
that do not apply to it, the ones that must be >= 1, > 0 or >= 0 when given, and `resolve` fills
and checks the parsed options by it, then puts the plot next to the JSON record. The closed loop's
requests per level is a default of this kind too. The open loop has two checks of its own: the
capacity run's options need `--rate auto` (a fixed list of rates skips that run), and
`--gateway-metrics` is for a stack started elsewhere (`--spawn` knows its own gateway's). This
module must stay cheap to import (`strata --help` builds the parser that uses it): no gRPC, torch
nor model code; it must not parse the command line (bench/stack.py does) nor run anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

# A level sends at least this many requests, so the lowest levels still give a median of several.
MIN_REQUESTS_PER_LEVEL = 8
# Rule 6 of bench/README.md: a median and a spread need three; --smoke may take one.
MIN_RUNS = 3


@dataclass(frozen=True, slots=True)
class Mode:
    """One load's option rules; every name is an argparse destination."""

    runs: str
    """What a run is called in its error message."""
    defaults: dict[str, Any]
    smoke: dict[str, Any]
    excluded: tuple[str, ...] = ()
    """Options that do not apply: given, they are an error."""
    at_least_one: tuple[str, ...] = ()
    positive: tuple[str, ...] = ()
    non_negative: tuple[str, ...] = ()


CLOSED_LOOP = Mode(
    runs="timed runs",
    defaults={
        "concurrency": (1, 8, 32, 64),
        "prompt_tokens": 64,
        "new_tokens": 64,
        "runs": 3,
        "warmup_requests": 8,
    },
    smoke={"concurrency": (1, 4), "prompt_tokens": 16, "new_tokens": 8, "runs": 1, "warmup_requests": 2},
    at_least_one=("prompt_tokens", "new_tokens", "ttft_requests", "requests_per_level"),
    non_negative=("warmup_requests",),
)
# Open loop (--rate): shorter requests, so three rounds of two phases take a few minutes on 2 cores.
OPEN_LOOP = Mode(
    runs="rounds",
    defaults={
        "prompt_tokens": 32,
        "new_tokens": 32,
        "runs": 3,
        "warmup_requests": 4,
        "duration": 20.0,
        "gap": 3.0,
        "rate_factor": 2.0,
    },
    smoke={
        "prompt_tokens": 16,
        "new_tokens": 8,
        "runs": 1,
        "warmup_requests": 2,
        "duration": 3.0,
        "gap": 0.5,
        "rate_factor": 2.0,
    },
    excluded=("engine_baseline", "concurrency", "requests_per_level"),
    at_least_one=("prompt_tokens", "new_tokens", "arrivals", "capacity_concurrency", "capacity_requests"),
    positive=("duration", "ttft_slo_ms", "rate_factor"),
    non_negative=("gap", "warmup_requests"),
)


# What only the capacity run of --rate auto uses.
AUTO_ONLY = ("rate_factor", "capacity_concurrency", "capacity_requests")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _open_loop_problem(args: argparse.Namespace) -> str | None:
    """What the open loop alone refuses, checked before the defaults fill anything in."""
    given = [_flag(name) for name in AUTO_ONLY if getattr(args, name) is not None]
    if args.rate != "auto" and given:
        return f"{', '.join(given)}: only --rate auto measures the capacity; a list of rates skips it"
    if args.spawn and args.gateway_metrics is not None:
        return "--gateway-metrics is for a stack started elsewhere: --spawn reads its own gateway's"
    return None


def resolve(args: argparse.Namespace) -> str | None:
    """Fill the defaults that depend on --smoke (and --rate); the problem with the options, or None."""
    mode = OPEN_LOOP if args.rate is not None else CLOSED_LOOP
    if any(getattr(args, name) not in (None, False) for name in mode.excluded):
        return f"--rate is an open loop: {', '.join(_flag(name) for name in mode.excluded)} do not apply"
    if mode is OPEN_LOOP and (problem := _open_loop_problem(args)) is not None:
        return problem
    for name, default in mode.defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, mode.smoke[name] if args.smoke else default)
    if args.runs < 1 or (args.runs < MIN_RUNS and not args.smoke):
        return f"--runs {args.runs}: at least {MIN_RUNS} {mode.runs} (median and spread); --smoke allows 1"
    for names, bound, breaks in (
        (mode.at_least_one, ">= 1", lambda value: value < 1),
        (mode.positive, "> 0", lambda value: not value > 0),
        (mode.non_negative, ">= 0", lambda value: value < 0),
    ):
        for name in names:
            value = getattr(args, name)
            if value is not None and breaks(value):
                return f"{_flag(name)} {value} must be {bound}"
    if args.plot is None and args.json is not None:
        args.plot = args.json.with_suffix(".png")
    return None


def requests_per_level(args: argparse.Namespace, concurrency: int) -> int:
    """At N >= 8 one request per stream by default: the top level is N requests sent at once."""
    if args.requests_per_level is not None:
        return int(args.requests_per_level)
    return max(concurrency, MIN_REQUESTS_PER_LEVEL)
