"""A promise for the tokens after the first: the open loop at a fixed rate on the default mix, the route
promising `--itl-slo-ms` between tokens against the same route promising only the first token.

    python -m bench.itl_admission [--rate 14] [--rounds 5] [--duration 30] [--json PATH]   (make bench-itl)

The workload is `strata bench --rate`'s default mix: prompts of `--prompt-tokens` (32) tokens of their
own, `--new-tokens` (32) greedy with EOS ignored, no_fallback, interactive, Poisson arrivals at
`--rate` (14) requests/s (bench/rate.py). The route is the config's first (its fallback left out),
its TTFT SLO as the config has it. Two phases alternate over `--rounds` (5), the order reversed every
other round, each on freshly started services under a gateway in this process
(bench/inprocess_gateway.py): `ttft` (itl_slo_ms 0, the default) and `itl` (itl_slo_ms
`--itl-slo-ms`, 150). A phase's figures are bench/rate_phase.py's (admitted requests' TTFT p99, the
inter-token gaps' percentiles over completed requests, goodput of requests meeting the TTFT SLO) and
the goodput of requests meeting both promises: TTFT within its SLO and mean time per output token
(TPOT, as vLLM's `--goodput tpot:` counts it) within the ITL SLO. The targets: the `itl` phase's
inter-token p99 within 1.1x the ITL SLO, its admitted TTFT p99 within 1.1x the TTFT SLO, and its
goodput of both at least 0.9x the `ttft` phase's goodput counting only TTFT (medians of the rounds).
This module runs and records; it must not change a service's code.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.admission import met_slo
from bench.inprocess_gateway import first_route, in_process_gateway, model_dir, services
from bench.load import run_level
from bench.provenance import finish_provenance, start_provenance
from bench.rate import arrival_offsets, drain, rate_request, run_phase
from bench.rate_phase import aggregate_phase, summarize_phase
from bench.stack_prompts import build_prompts, load_tokenizer
from bench.stats import save_record, summarize
from gateway.settings import RouteSettings
from strata.settings import DEFAULT_CONFIG

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tokenizers import Tokenizer

    from bench.driver import RequestResult
    from bench.stack_prompts import Prompt
    from strata.cli.launcher import Stack

PHASES = ("ttft", "itl")
TARGET_ITL_P99_OVER_SLO = 1.1
TARGET_TTFT_P99_OVER_SLO = 1.1
TARGET_GOODPUT_OVER_TTFT_ONLY = 0.9
WARM_REQUESTS = 24
WORKLOAD_KEYS = ("rate", "duration", "prompt_tokens", "new_tokens", "itl_slo_ms", "rounds", "seed")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.itl_admission",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--rate", type=float, default=14.0, help="offered requests per second")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals a phase")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--itl-slo-ms", type=float, default=150.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--gap", type=float, default=2.0)
    parser.add_argument("--seed", default="itl-admission")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.rounds < 5:
        parser.error(f"--rounds {args.rounds}: at least 5, for a ratio's median and spread")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens {args.new_tokens}: at least 2, or there is no token after the first")
    return args


def both_met(result: RequestResult, ttft_slo_ms: float, itl_slo_ms: float) -> bool:
    """A completed request whose first token met the TTFT SLO and whose mean time per output token
    after the first (TPOT) met the ITL SLO."""
    if result.status != "OK" or not met_slo(result, ttft_slo_ms) or not result.itl_s:
        return False
    return 1000.0 * statistics.fmean(result.itl_s) <= itl_slo_ms


def summarize_itl_phase(
    results: Sequence[RequestResult], *, phase: str, wall_s: float, prompts: Sequence[Prompt],
    new_tokens: int, ttft_slo_ms: float, itl_slo_ms: float, primary: str,
) -> dict[str, Any]:  # fmt: skip
    """rate_phase's figures of one round, and the goodput of requests meeting both promises."""
    summary = summarize_phase(
        results, phase=phase, wall_s=wall_s, input_tokens=[len(p.token_ids) for p in prompts],
        new_tokens=new_tokens, slo_ms=ttft_slo_ms, primary=primary,
    )  # fmt: skip
    both = [r for r in results if both_met(r, ttft_slo_ms, itl_slo_ms)]
    tokens = sum(len(r.token_ids) for r in both)
    summary["good_both_requests"] = len(both)
    summary["goodput_both_tok_s"] = tokens / wall_s if wall_s > 0 else 0.0
    return summary


async def _phase(
    args: argparse.Namespace, stack: Stack, route: dict[str, Any], tokenizer: Tokenizer, phase: str, tag: str
) -> dict[str, Any]:
    model = str(route["model"])
    offsets = arrival_offsets(
        args.rate, max(1, round(args.rate * args.duration)), "poisson", f"{args.seed}/arrivals"
    )
    prompts = build_prompts(tokenizer, len(offsets), args.prompt_tokens, f"{args.seed}/{tag}")
    warm = build_prompts(tokenizer, WARM_REQUESTS, args.prompt_tokens, f"{args.seed}/warm")
    itl_slo_ms = args.itl_slo_ms if phase == "itl" else 0.0
    async with in_process_gateway(stack, {**route, "itl_slo_ms": itl_slo_ms}) as stub:
        # Untimed: the forecast learns the steps, and with the promise the worker's caps settle.
        warming = [
            rate_request(p, args.new_tokens, f"warm-{i}", model, fallback=False) for i, p in enumerate(warm)
        ]
        await run_level(stub, warming, 8, timeout_s=args.timeout, label="warm", progress=False)
        await drain(stub, args.gap)
        requests = [
            rate_request(p, args.new_tokens, f"{tag}-{i}", model, fallback=False)
            for i, p in enumerate(prompts)
        ]
        results, wall = await run_phase(
            stub, requests, offsets, timeout_s=args.timeout, label=tag, progress=False
        )
    return summarize_itl_phase(
        results, phase=phase, wall_s=wall, prompts=prompts, new_tokens=args.new_tokens,
        ttft_slo_ms=float(route["ttft_slo_ms"]), itl_slo_ms=args.itl_slo_ms, primary=model,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    provenance = start_provenance()
    directory = Path(tempfile.mkdtemp(prefix="strata-itl-admission-"))
    route = first_route(args.config)
    route.setdefault("ttft_slo_ms", RouteSettings.model_fields["ttft_slo_ms"].default)
    tokenizer = load_tokenizer(model_dir(args.config, str(route["model"])))
    runs: dict[str, list[dict[str, Any]]] = {phase: [] for phase in PHASES}
    for round_index in range(args.rounds):
        order = PHASES if round_index % 2 == 0 else tuple(reversed(PHASES))
        for phase in order:
            with services(args.config, directory / f"{phase}-{round_index}") as stack:
                got = asyncio.run(_phase(args, stack, route, tokenizer, phase, f"{phase}-r{round_index}"))
            runs[phase].append(got)
            print(f"itl_admission: round {round_index + 1} {phase}: {got['goodput_tok_s']:.1f} good tok/s "
                  f"(both {got['goodput_both_tok_s']:.1f}), ITL p99 {got['itl_ms']['p99']:.0f} ms, "
                  f"{got['refused']} of {got['offered']} refused", file=sys.stderr)  # fmt: skip
    phases = {phase: _aggregate(phase_runs) for phase, phase_runs in runs.items()}
    record = {
        "benchmark": "bench.itl_admission",
        "provenance": finish_provenance(provenance),
        "workload": {key: getattr(args, key) for key in WORKLOAD_KEYS},
        "model": route["model"],
        "ttft_slo_ms": float(route["ttft_slo_ms"]),
        "phases": phases,
        "target": target(runs, float(route["ttft_slo_ms"]), args.itl_slo_ms),
    }
    save_record(record, args.json)
    return 0


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    both = summarize([run["goodput_both_tok_s"] for run in runs])
    return {
        **aggregate_phase(runs),
        "goodput_both_tok_s": both.median,
        "goodput_both_tok_s_spread": [both.low, both.high],
        "good_both_requests": sum(run["good_both_requests"] for run in runs),
    }


def target(runs: dict[str, list[dict[str, Any]]], ttft_slo_ms: float, itl_slo_ms: float) -> dict[str, Any]:
    """The `itl` phase's inter-token and admitted TTFT p99 (medians of the rounds) against their SLOs,
    and its goodput of both against the `ttft` phase's TTFT goodput: per round and their median."""
    itl = runs["itl"]
    itl_p99 = statistics.median(run["itl_ms"]["p99"] for run in itl)
    ttft_p99s = [run["routes"]["primary"]["ttft_ms"]["p99"] for run in itl]
    ttft_p99 = statistics.median(p if p is not None else float("inf") for p in ttft_p99s)
    ratios = [
        mine["goodput_both_tok_s"] / theirs["goodput_tok_s"] if theirs["goodput_tok_s"] else 0.0
        for mine, theirs in zip(itl, runs["ttft"], strict=True)
    ]
    ratio = summarize(ratios)
    return {
        "itl_p99_over_slo_at_most": TARGET_ITL_P99_OVER_SLO,
        "itl_p99_over_slo": itl_p99 / itl_slo_ms,
        "itl_met": itl_p99 <= TARGET_ITL_P99_OVER_SLO * itl_slo_ms,
        "ttft_p99_over_slo_at_most": TARGET_TTFT_P99_OVER_SLO,
        "ttft_p99_over_slo": ttft_p99 / ttft_slo_ms,
        "ttft_met": ttft_p99 <= TARGET_TTFT_P99_OVER_SLO * ttft_slo_ms,
        "goodput_over_ttft_only_at_least": TARGET_GOODPUT_OVER_TTFT_ONLY,
        "goodput_over_ttft_only": ratio.median,
        "goodput_over_ttft_only_spread": [ratio.low, ratio.high],
        "goodput_over_ttft_only_rounds": list(ratio.values),
        "goodput_met": ratio.median >= TARGET_GOODPUT_OVER_TTFT_ONLY,
        "ttft_phase_itl_p99_over_slo": statistics.median(run["itl_ms"]["p99"] for run in runs["ttft"])
        / itl_slo_ms,
    }


if __name__ == "__main__":
    raise SystemExit(main())
