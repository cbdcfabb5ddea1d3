"""`strata bench` (and `python -m bench.stack`): load the running Strata stack over gRPC and report.

For each concurrency N of a sweep, N closed-loop streams send GenerateStream requests of a fixed
prompt length (texts built to tokenize to exactly that many tokens) and output length (greedy, EOS
ignored); the record has output tokens/s, requests/s, TTFT, inter-token and end-to-end latency
percentiles, refusals and errors per level, as a JSON record and PNG plots. A level sends max(N, 8)
requests by default: from N = 8 on, one per stream, all at once (the workload the engine baseline
runs); at N = 1, eight back to back, so its TTFT is a median of several. `--engine-baseline`
times the in-process engine on the same token ids in the same run, alternating with the stack
(bench/README.md's rules), and judges the stack against it. `--rate R[,R...]` (or auto) replaces the
sweep with open-loop arrivals at each rate, fallback off and on (bench/rate_run.py). This module is
the command line only: it must stay cheap to import (`strata --help` builds this parser), so the
options' defaults and checks live in bench/options.py and the work in bench/stack_run.py and
bench/rate_run.py, imported when the command runs; neither of those may import this module.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from bench.options import MIN_REQUESTS_PER_LEVEL, resolve

DEFAULT_ADDRESS = "127.0.0.1:50051"


def _concurrency_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers, e.g. 1,8,32,64"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every concurrency must be >= 1, e.g. 1,8,32,64")
    return tuple(sorted(set(values)))


def _rates(text: str) -> str | tuple[float, ...]:
    """--rate: auto, or a comma-separated list of requests/s (each finite and > 0, none twice), in order."""
    if text == "auto":
        return text
    example = "requests/s > 0, a comma-separated list of them (e.g. 14,28), or auto alone"
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty rate: {example}")
    try:
        values = tuple(float(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate: {example}") from None
    for part, value in zip(parts, values, strict=True):
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{text!r}: {part} is no rate: {example}")
    if len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"{text!r} names a rate twice: each rate runs once, in order")
    return values


def _host_port(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT, e.g. 127.0.0.1:9464")
    return text


def _add_rate_arguments(parser: argparse.ArgumentParser) -> None:
    rate = parser.add_argument_group(
        "open loop (--rate)",
        "Requests arrive at R/s whatever the stack answers; each round runs the same schedule with "
        "fallback off (no_fallback) then on (allow_fallback). A request not refused within 50 ms is "
        "admitted and counts toward the TTFT SLO whatever happens to it later.",
    )
    rate.add_argument(
        "--rate", type=_rates,
        help="requests/s, a comma-separated list of them run one after the other (e.g. 14,28), or "
        "auto: --rate-factor x the primary's measured capacity",
    )  # fmt: skip
    rate.add_argument("--duration", type=float, help="seconds of arrivals per phase (default: 20; smoke 3)")
    rate.add_argument("--arrivals", type=int, help="requests per phase (default: rate x --duration)")
    rate.add_argument(
        "--arrival", choices=("poisson", "fixed"), default="poisson",
        help="poisson: seeded exponential gaps; fixed: every 1/R s (default: %(default)s)",
    )  # fmt: skip
    rate.add_argument(
        "--ttft-slo-ms", type=float,
        help="the TTFT SLO: goodput counts requests within it, the admitted p99 must be within 1.1x it "
        "(default: the route's ttft_slo_ms in --config, else the gateway's default, else 2000)",
    )  # fmt: skip
    rate.add_argument("--gap", type=float, help="idle seconds between phases (default: 3; smoke 0.5)")
    rate.add_argument("--rate-factor", type=float, help="--rate auto: times the capacity (default: 2)")
    rate.add_argument(
        "--capacity-concurrency", type=int,
        help="--rate auto: closed-loop streams (default: the primary worker's engine.max_num_seqs)",
    )  # fmt: skip
    rate.add_argument(
        "--capacity-requests",
        type=int,
        help="--rate auto: requests of the capacity run (default: 2 x streams)",
    )
    rate.add_argument(
        "--gateway-metrics", type=_host_port, metavar="HOST:PORT",
        help="the gateway's /metrics, scraped around each phase for its own refusal decision time "
        "(with --spawn: the spawned gateway's; without either: not measured)",
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `strata bench`; sizes left unset take the defaults, or tiny ones with --smoke."""
    target = parser.add_argument_group("the stack")
    target.add_argument("--address", default=DEFAULT_ADDRESS, help="gateway HOST:PORT (default: %(default)s)")
    target.add_argument(
        "--spawn",
        action="store_true",
        help="start the stack from --config (gateway on a free port), stop it after",
    )
    target.add_argument(
        "--config", type=Path, help="stack config: the model folder and the engine baseline's settings "
        "come from its first worker (default: configs/local.yaml)",
    )  # fmt: skip
    target.add_argument(
        "--model-dir", type=Path, help="tokenizer and engine model folder (default: from --config)"
    )
    target.add_argument(
        "--model", default="", help="GenerateRequest.model (default: the gateway's default route)"
    )
    target.add_argument("--log-dir", type=Path, help="with --spawn: where the services write their logs")

    workload = parser.add_argument_group("the workload")
    workload.add_argument(
        "--concurrency", type=_concurrency_list,
        help="comma-separated stream counts (default: 1,8,32,64; with --smoke 1,4)",
    )  # fmt: skip
    workload.add_argument(
        "--requests-per-level", type=int,
        help=f"requests each level sends through its streams (default: max(N, {MIN_REQUESTS_PER_LEVEL}))",
    )  # fmt: skip
    workload.add_argument("--prompt-tokens", type=int, help="prompt length in tokens (default: 64)")
    workload.add_argument("--new-tokens", type=int, help="tokens generated per request (default: 64)")
    workload.add_argument("--runs", type=int, help="timed sweeps, alternated with the engine (default: 3)")
    workload.add_argument(
        "--warmup-requests", type=int, help="untimed concurrent requests first (default: 8)"
    )
    workload.add_argument(
        "--timeout", type=float, default=600.0, help="per-request deadline, s (default: 600)"
    )
    workload.add_argument("--seed", default="0", help="prompt texts' seed (default: %(default)s)")

    baseline = parser.add_argument_group("the engine baseline")
    baseline.add_argument(
        "--engine-baseline", action="store_true",
        help="also time the in-process engine on the same token ids after each sweep, and report the ratios",
    )  # fmt: skip
    baseline.add_argument(
        "--ttft-requests", type=int, default=MIN_REQUESTS_PER_LEVEL,
        help="engine baseline: single requests its TTFT median is taken on (default: %(default)s)",
    )  # fmt: skip
    baseline.add_argument(
        "--threads", type=int, help="engine baseline: torch threads (default: the worker's)"
    )

    _add_rate_arguments(parser)

    output = parser.add_argument_group("output")
    output.add_argument("--json", type=Path, help="where to write the JSON record")
    output.add_argument("--plot", type=Path, help="where to write the PNG (default: the --json path, .png)")
    output.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    output.add_argument(
        "--smoke", action="store_true", help="tiny sizes, --runs 1 allowed; the record is invalid"
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark these parsed options describe; 0, or 1 when its numbers do not count."""
    problem = resolve(args)
    if problem is not None:
        print(f"strata bench: error: {problem}", file=sys.stderr)
        return 2
    from bench.session import BenchError

    try:
        if args.rate is not None:
            from bench.rate_run import run_rate_benchmark

            return run_rate_benchmark(args)
        from bench.stack_run import run_benchmark

        return run_benchmark(args)
    except BenchError as exc:
        print(f"strata bench: error: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stack", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
