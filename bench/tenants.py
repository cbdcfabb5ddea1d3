"""`python -m bench.tenants`: does fair queuing keep a quiet tenant's promise next to a noisy one?

Two tenants of equal weight share the default stack's primary (no_fallback): a noisy one offering
5x its shape's capacity in 512-token prompts and a quiet one offering 0.3x in 32-token prompts, both
open-loop Poisson, 32 new tokens each. Fair queuing on and off (FIFO) alternate over 3 rounds, each
round of each on a fresh stack; reported per contestant: the quiet tenant's admitted TTFT p99 and
served share, each tenant's goodput and Jain's index over the tenants' normalized throughputs. The
work is bench/tenant_run.py's, imported when the command runs; this module is the command line
only: the options, their defaults (full and --smoke) and their checks. It must not start a stack.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

DEFAULT_JSON = Path("bench/results/tenants-cpu.json")
# Rule 6 of bench/README.md: a median and a spread need three; --smoke may take one.
MIN_RUNS = 3
DEFAULTS = {
    "runs": 3,
    "duration": 20.0,
    "gap": 3.0,
    "new_tokens": 32,
    "noisy_prompt_tokens": 512,
    "quiet_prompt_tokens": 32,
    "warmup_requests": 4,
}
SMOKE = {
    "runs": 1,
    "duration": 3.0,
    "gap": 0.5,
    "new_tokens": 8,
    "noisy_prompt_tokens": 64,
    "quiet_prompt_tokens": 16,
    "warmup_requests": 1,
}
AT_LEAST_ONE = (
    "new_tokens",
    "noisy_prompt_tokens",
    "quiet_prompt_tokens",
    "capacity_concurrency",
    "capacity_requests",
)
POSITIVE = ("duration", "noisy_factor", "quiet_factor", "ttft_slo_ms", "timeout")
NON_NEGATIVE = ("gap", "warmup_requests")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.tenants", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, help="stack config to copy (default: configs/local.yaml)")
    parser.add_argument("--model", default="", help="GenerateRequest.model (default: the gateway's default)")
    parser.add_argument("--model-dir", type=Path, help="tokenizer folder (default: the primary worker's)")
    parser.add_argument("--runs", type=int, help="rounds of both contestants (default: 3; smoke 1)")
    parser.add_argument("--duration", type=float, help="seconds of arrivals per phase (default: 20)")
    parser.add_argument("--gap", type=float, help="idle seconds before each phase (default: 3)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per request (default: 32)")
    parser.add_argument("--noisy-prompt-tokens", type=int, help="the noisy tenant's prompts (default: 512)")
    parser.add_argument("--quiet-prompt-tokens", type=int, help="the quiet tenant's prompts (default: 32)")
    parser.add_argument(
        "--noisy-factor", type=float, default=5.0,
        help="the noisy tenant's rate, times its shape's capacity (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--quiet-factor", type=float, default=0.3,
        help="the quiet tenant's rate, times its shape's capacity (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--capacity-concurrency", type=int,
        help="closed-loop streams of the capacity run (default: the primary worker's engine.max_num_seqs)",
    )  # fmt: skip
    parser.add_argument("--capacity-requests", type=int, help="requests per shape (default: 2 x streams)")
    parser.add_argument(
        "--ttft-slo-ms", type=float,
        help="the TTFT SLO (default: the route's ttft_slo_ms in --config, else the gateway's default)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup-requests", type=int, help="untimed requests per tenant and stack (default: 4)"
    )
    parser.add_argument("--seed", default="0", help="prompts' and schedules' seed (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, s (default: 600)")
    parser.add_argument("--log-dir", type=Path, help="where the config copies and service logs go")
    parser.add_argument("--json", type=Path, help=f"the record (default: {DEFAULT_JSON}; none with --smoke)")
    parser.add_argument("--plot", type=Path, help="the PNG (default: the --json path, .png)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 1 round; the record is invalid")
    return parser


def resolve(args: argparse.Namespace) -> str | None:
    """Fill the defaults (tiny ones with --smoke) and check the options; the problem, or None."""
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, SMOKE[name] if args.smoke else default)
    if args.runs < 1 or (args.runs < MIN_RUNS and not args.smoke):
        return f"--runs {args.runs}: at least {MIN_RUNS} rounds (median and spread); --smoke allows 1"
    for names, bound, breaks in (
        (AT_LEAST_ONE, ">= 1", lambda value: value < 1),
        (POSITIVE, "> 0 and finite", lambda value: not (value > 0 and math.isfinite(value))),
        (NON_NEGATIVE, ">= 0", lambda value: value < 0),
    ):
        for name in names:
            value = getattr(args, name)
            if value is not None and breaks(value):
                return f"--{name.replace('_', '-')} {value} must be {bound}"
    if args.json is None and not args.smoke:
        args.json = DEFAULT_JSON
    if args.plot is None and args.json is not None:
        args.plot = args.json.with_suffix(".png")
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0, 1 when it could not run or its numbers do not count, 2 for bad options."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = resolve(args)
    if problem is not None:
        parser.error(problem)
    from bench.session import BenchError
    from bench.tenant_run import run_tenant_benchmark
    from strata.settings import SettingsError

    try:
        return run_tenant_benchmark(args)
    except (BenchError, SettingsError) as exc:
        print(f"bench.tenants: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
