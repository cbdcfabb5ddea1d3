"""Admission on prompts the prefix cache holds: the open loop on a mix where most prompts share a long
system prompt; the gateway's forecast guessing what its worker has cached, against the same gateway
pricing every prompt token as computed, and against an oracle told each prompt's true cached length.

    python -m bench.cached_admission [--rounds 3] [--duration 60] [--json PATH]   (make bench-cached)

The workload: `--shared-share` (0.9) of the requests are one of `--system-prompts` (4) system prompts
of `--system-tokens` (1,000) tokens followed by a question of `--question-tokens` (32) of their own;
the rest are a system prompt of the same size of their own, then a question. Each is raw text,
greedy, EOS ignored, `--new-tokens` (32) a request, no_fallback, interactive, Poisson arrivals
(bench/rate.py). The offered rate is `--rate-factor` (2) times the capacity measured at the start of
the same run: a closed loop of `--capacity-concurrency` (16) streams over `--capacity-requests` (96)
of the mix, through the route with its SLO off (what the worker completes, not what admission lets
in), after one request of each shared system prompt (the steady state, where they are cached). The
route's SLO is `--ttft-slo-ms` (4,000): a cold 1,100-token prompt's first token takes about a second
alone on a 2-core machine (bench/results/prefix-cache-cpu.json), so under load the default 2 s
refuses every uncached prompt and never lets a system prompt get cached.

Every phase starts the config's tokenizer and workers as processes (a cold prefix cache), then a
gateway in this process on them with the config's first route (its fallback left out), the one thing
changed being how it forecasts: `guess` (the product: forecast_cached_prompts on), `price_all`
(off), `oracle` (on, each stream's guesses replaced by OracleCache, which knows which prompt shares
which system prompt and how many tokens: the most a guess could be worth; an oracle cannot be the
product's code, which is why the gateway runs here). The three alternate over `--rounds` (3), the
order reversed every other round. A phase's figures are bench/rate_phase.py's: admitted requests'
TTFT p99 against the route's SLO, goodput (output tokens/s of completed requests that met it),
refusals by reason. The targets: the guess's admitted TTFT p99 within 1.1x the SLO and its goodput
at least 0.9x the oracle's (medians of the rounds). This module runs and records; it must not change
a service's code.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.inprocess_gateway import first_route, in_process_gateway, model_dir, services
from bench.load import run_level, summarize_level
from bench.provenance import finish_provenance, start_provenance
from bench.rate import arrival_offsets, drain, run_phase
from bench.rate_phase import aggregate_phase, summarize_phase
from bench.stack_prompts import Prompt, build_prompt, load_tokenizer
from bench.stats import save_record
from gateway.prompt_prefix import CachedPrefixes, PromptPrefix, prompt_prefix
from gateway.tenant_settings import DEFAULT_TENANT
from strata.settings import DEFAULT_CONFIG
from strata.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    import contextlib
    from collections.abc import Mapping

    from bench.driver import Stub
    from gateway.server import GatewayServer
    from strata.cli.launcher import Stack

MODES = {"guess": True, "price_all": False, "oracle": True}
"""Each contestant's forecast_cached_prompts (the oracle's guesses are replaced by the truth)."""
TARGET_TTFT_P99_OVER_SLO = 1.1
TARGET_GOODPUT_OVER_ORACLE = 0.9
WORKLOAD_KEYS = (
    "duration", "system_prompts", "system_tokens", "question_tokens", "shared_share", "new_tokens",
    "rate_factor", "capacity_concurrency", "capacity_requests", "ttft_slo_ms", "rounds", "seed",
)  # fmt: skip

Truth = dict[PromptPrefix, tuple[int | None, int]]
"""A prompt's piece hashes -> (its shared system prompt's index, None for its own; the tokens it shares
with that system prompt)."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cached_admission",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals a phase")
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--shared-share", type=float, default=0.9)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rate-factor", type=float, default=2.0)
    parser.add_argument("--capacity-concurrency", type=int, default=16)
    parser.add_argument("--capacity-requests", type=int, default=96)
    parser.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=4000.0,
        help="the route's SLO (a cold 1,000-token prompt's prefill must fit it under load)",
    )
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--gap", type=float, default=2.0)
    parser.add_argument("--seed", default="cached-admission")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error(f"--rounds {args.rounds}: at least 3, for a median and a spread")
    return args


class Mix:
    """The workload's texts: the shared system prompts, and a maker of each phase's requests."""

    def __init__(self, args: argparse.Namespace, model_dir: Path) -> None:
        self._args = args
        self._tokenizer = load_tokenizer(model_dir)
        rng = random.Random(f"{args.seed}/systems")
        self.systems = [
            build_prompt(self._tokenizer, args.system_tokens, rng) for _ in range(args.system_prompts)
        ]
        self.truth: Truth = {}
        """Every prompt made so far, for the oracle."""

    def prompts(self, count: int, seed: str) -> list[Prompt]:
        """`count` prompts of the mix: a shared or an own system prompt, then a question of its own.
        Each shared one's truth (its system prompt, the tokens it shares with it) goes into `truth`."""
        rng = random.Random(seed)
        prompts: list[Prompt] = []
        seen: set[str] = set()
        for _ in range(count):
            shared = rng.randrange(len(self.systems)) if rng.random() < self._args.shared_share else None
            if shared is not None:
                system = self.systems[shared].text
            else:
                system = build_prompt(self._tokenizer, self._args.system_tokens, rng).text
            text = system
            while text == system or text in seen:  # each prompt of a phase its own
                text = f"{system}\n\n{build_prompt(self._tokenizer, self._args.question_tokens, rng).text}"
            seen.add(text)
            prompt = self._prompt(text)
            head = self._tokenizer.encode(f"{system}\n\n").ids
            pairs = zip(head, prompt.token_ids, strict=False)
            common = next((i for i, (x, y) in enumerate(pairs) if x != y), len(head))
            prefix = prompt_prefix(gateway_pb2.GenerateRequest(prompt=prompt.text), DEFAULT_TENANT)
            self.truth[prefix] = (shared, common)
            prompts.append(prompt)
        return prompts

    def _prompt(self, text: str) -> Prompt:
        return Prompt(text, tuple(self._tokenizer.encode(text).ids))

    def requests(self, prompts: list[Prompt], model: str, tag: str) -> list[gateway_pb2.GenerateRequest]:
        sampling = common_pb2.SamplingParams(max_new_tokens=self._args.new_tokens, ignore_eos=True)
        return [
            gateway_pb2.GenerateRequest(
                prompt=p.text, model=model, sampling=sampling, request_id=f"{tag}-{i}", no_fallback=True,
                priority=gateway_pb2.PRIORITY_INTERACTIVE,
            )
            for i, p in enumerate(prompts)
        ]  # fmt: skip


class OracleCache(CachedPrefixes):
    """A stream's memory told the truth: a shared system prompt counts as cached from the first time the
    worker prefilled a prompt holding it (4 of them fit any worker's cache, so none is evicted), and a
    prompt's cached tokens are those it truly shares with it, in whole blocks. Not the product's code:
    what the guess would be if it were never wrong."""

    def __init__(self, truth: Mapping[PromptPrefix, tuple[int | None, int]], block_tokens: int) -> None:
        super().__init__()
        self._truth = truth
        self.block_tokens = block_tokens
        self._prefilled: set[int] = set()

    def clear(self) -> None:
        super().clear()
        self._prefilled.clear()

    def cached_tokens(self, prefix: PromptPrefix) -> int:
        system, tokens = self._truth.get(prefix, (None, 0))
        return tokens // self.block_tokens * self.block_tokens if system in self._prefilled else 0

    def prefilled(self, prefix: PromptPrefix, prompt_tokens: int) -> None:
        system, _ = self._truth.get(prefix, (None, 0))
        if system is not None:
            self._prefilled.add(system)

    def confirmed(self, guessed: int, served: int) -> None:
        """The truth needs no confirming."""


def _route(args: argparse.Namespace) -> tuple[dict[str, Any], str, float]:
    """The config's first route (its fallback left out: no request may use it), its model and SLO (ms)."""
    route = {**first_route(args.config), "ttft_slo_ms": args.ttft_slo_ms}
    return route, str(route["model"]), args.ttft_slo_ms


def _gateway(
    stack: Stack, route: dict[str, Any], mode: str, mix: Mix
) -> contextlib.AbstractAsyncContextManager[Stub]:
    """A gateway in this process on `stack`'s services, its one route as `mode` forecasts."""

    def oracle(server: GatewayServer) -> None:
        for link in server.router.route(route["model"]).links:
            link.load.cache = OracleCache(mix.truth, link.load.cache.block_tokens)

    forecasting = {**route, "forecast_cached_prompts": MODES[mode]}
    return in_process_gateway(stack, forecasting, oracle if mode == "oracle" else None)


async def _warm(stub: Stub, mix: Mix, model: str) -> None:
    """Untimed: a few short unrelated prompts, so the forecast knows the steps (none of the mix's)."""
    prompts = [Prompt(f"Warm-up {i}: say something short.", ()) for i in range(4)]
    await run_level(
        stub, mix.requests(prompts, model, "warm"), 4, timeout_s=120.0, label="warm", progress=False
    )


async def _capacity(
    args: argparse.Namespace, mix: Mix, stack: Stack, route: dict[str, Any]
) -> dict[str, Any]:
    model = route["model"]
    # What the worker completes, not what admission lets in: no SLO, a queue for every stream.
    serving = {**route, "ttft_slo_ms": 0.0, "max_queued_requests": args.capacity_concurrency}
    async with _gateway(stack, serving, "guess", mix) as stub:
        await _warm(stub, mix, model)
        # The mix's steady state: every shared system prompt cached, as it is after a phase's first seconds.
        systems = [Prompt(system.text, ()) for system in mix.systems]
        await run_level(
            stub,
            mix.requests(systems, model, "cache"),
            1,
            timeout_s=args.timeout,
            label="cache",
            progress=False,
        )
        prompts = mix.prompts(args.capacity_requests, f"{args.seed}/capacity")
        run = await run_level(
            stub, mix.requests(prompts, model, "capacity"), args.capacity_concurrency,
            timeout_s=args.timeout, label="capacity", progress=False,
        )  # fmt: skip
    summary = summarize_level(run, [len(p.token_ids) for p in prompts], args.new_tokens)
    keys = ("requests", "completed", "wall_s", "requests_per_s", "output_tok_s", "refusals", "errors")
    return {"concurrency": args.capacity_concurrency, **{key: summary[key] for key in keys}}


async def _phase(
    args: argparse.Namespace, mix: Mix, stack: Stack, route: dict[str, Any], rate: float, mode: str, tag: str
) -> dict[str, Any]:
    model = route["model"]
    offsets = arrival_offsets(rate, max(1, round(rate * args.duration)), "poisson", f"{args.seed}/arrivals")
    prompts = mix.prompts(len(offsets), f"{args.seed}/{tag}")
    async with _gateway(stack, route, mode, mix) as stub:
        await _warm(stub, mix, model)
        await drain(stub, args.gap)
        results, wall = await run_phase(
            stub,
            mix.requests(prompts, model, tag),
            offsets,
            timeout_s=args.timeout,
            label=tag,
            progress=False,
        )
    return summarize_phase(
        results, phase=mode, wall_s=wall, input_tokens=[len(p.token_ids) for p in prompts],
        new_tokens=args.new_tokens, slo_ms=route["ttft_slo_ms"],
        primary=model,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    provenance = start_provenance()
    directory = Path(tempfile.mkdtemp(prefix="strata-cached-admission-"))
    route, model, slo_ms = _route(args)
    mix = Mix(args, model_dir(args.config, model))
    with services(args.config, directory / "capacity") as stack:
        capacity = asyncio.run(_capacity(args, mix, stack, route))
    rate = args.rate_factor * capacity["requests_per_s"]
    print(
        f"cached_admission: capacity {capacity['requests_per_s']:.2f} req/s, offering {rate:.2f}",
        file=sys.stderr,
    )
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        order = list(MODES) if round_index % 2 == 0 else list(reversed(MODES))
        for mode in order:
            with services(args.config, directory / f"{mode}-{round_index}") as stack:
                got = asyncio.run(_phase(args, mix, stack, route, rate, mode, f"{mode}-r{round_index}"))
            runs[mode].append(got)
            print(f"cached_admission: round {round_index + 1} {mode}: {got['goodput_tok_s']:.1f} good tok/s, "
                  f"{got['refused']} of {got['offered']} refused", file=sys.stderr)  # fmt: skip
    phases = {mode: aggregate_phase(mode_runs) for mode, mode_runs in runs.items()}
    record = {
        "benchmark": "bench.cached_admission",
        "provenance": finish_provenance(provenance),
        "workload": {key: getattr(args, key) for key in WORKLOAD_KEYS},
        "model": model,
        "ttft_slo_ms": slo_ms,
        "capacity": capacity,
        "offered_rps": rate,
        "phases": phases,
        "target": _target(phases, slo_ms),
    }
    save_record(record, args.json)
    return 0


def _target(phases: dict[str, dict[str, Any]], slo_ms: float) -> dict[str, Any]:
    """The guess's admitted TTFT p99 (median of the rounds) against the SLO, its goodput against the
    oracle's and against pricing every token (medians)."""
    p99 = phases["guess"]["routes"]["primary"]["ttft_ms"]["p99"]
    goodput = {mode: phases[mode]["goodput_tok_s"] for mode in MODES}
    over_oracle = goodput["guess"] / goodput["oracle"] if goodput["oracle"] else None
    return {
        "admitted_ttft_p99_over_slo_at_most": TARGET_TTFT_P99_OVER_SLO,
        "guess_ttft_p99_over_slo": p99 / slo_ms if p99 is not None else None,
        "ttft_met": p99 is not None and p99 <= TARGET_TTFT_P99_OVER_SLO * slo_ms,
        "goodput_over_oracle_at_least": TARGET_GOODPUT_OVER_ORACLE,
        "goodput_guess_over_oracle": over_oracle,
        "goodput_met": over_oracle is not None and over_oracle >= TARGET_GOODPUT_OVER_ORACLE,
        "goodput_guess_over_price_all": goodput["guess"] / goodput["price_all"]
        if goodput["price_all"]
        else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
