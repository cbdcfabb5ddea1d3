"""`python -m bench.outputs`: what log probabilities and n samples cost, on the in-process engine.

Two parts, each with its contestants alternating after a warm-up of each, a fresh engine per run:

- logprobs: the engine benchmark's workload (64 streams, 64-token prompts, 64 new tokens, greedy,
  EOS ignored). `plain` asks for nothing; `logprobs5` asks every request for its tokens' logprobs
  and 5 alternatives; `one_asks` is plain but for one request with logprobs 5 (what the others pay
  for a neighbour that asks). Target: logprobs5 at least 0.95x plain's tokens/s. The greedy tokens
  must be identical in the three (logprobs never change a draw) and equal transformers' on the
  first --check-requests requests (the parity rule).
- samples: one 512-token prompt, 8 samples of 64 new tokens (temperature 1, seeded). `n8` runs them
  as the gateway runs n = 8 (gateway/samples.py): sample 0 first, the others once it has its first
  token, so they take the prompt's cached blocks; `separate8` submits 8 requests of the prompt at
  once, each with the same seed its sample has. Target: n8 takes less wall time than separate8 and
  computes the prompt's full blocks once; both must draw identical tokens.

Each part is its own run (`--part`) and record: bench/results/outputs-logprobs-cpu.json and
outputs-samples-cpu.json. This module must not change the engine's settings
between contestants.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.provenance import finish_provenance, start_provenance
from bench.stats import DEFAULT_MODEL, ParityReport, check_parity, make_prompts, save_record
from gateway.samples import sample_seed
from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable

DEFAULT_JSON = {
    "logprobs": Path("bench/results/outputs-logprobs-cpu.json"),
    "samples": Path("bench/results/outputs-samples-cpu.json"),
}
LOGPROB_CONTESTANTS = ("plain", "logprobs5", "one_asks")
SAMPLE_CONTESTANTS = ("n8", "separate8")
SEED = 1234


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.outputs", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--part", choices=("logprobs", "samples"), required=True)
    parser.add_argument("--runs", type=int, default=3, help="timed rounds of every contestant (>= 3)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=5, help="alternatives per token for logprobs5")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--sample-prompt-tokens", type=int, default=512)
    parser.add_argument("--check-requests", type=int, default=4, help="requests checked against transformers")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one run: the record is not valid")
    parser.add_argument("--json", type=Path, help="default: bench/results/outputs-<part>-cpu.json")
    return parser


class Bench:
    """The loaded model and what every run shares."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from services.worker.model.loader import load_model

        torch.set_num_threads(args.threads)
        self.args = args
        self.loaded = load_model(args.model)
        config = self.loaded.config
        self.excluded = set(config.eos_token_ids)
        self.vocab = config.vocab_size

    def engine(self, tokens: int, seqs: int) -> Any:
        from services.worker.engine.config import EngineConfig
        from services.worker.engine.engine import LLMEngine

        return LLMEngine(
            self.loaded, EngineConfig(max_num_seqs=seqs, num_blocks=-(-int(tokens * 1.1) // 16) + 8)
        )


def _drive(engine: Any, pending: dict[str, list[int]], on_first: Any = None) -> dict[str, float]:
    """Step until every request in `pending` finished, filling its tokens; each one's first-token time."""
    started = time.perf_counter()
    first: dict[str, float] = {}
    open_ = set(pending)
    while open_:
        for out in engine.step():
            if out.request_id not in pending:
                continue
            pending[out.request_id].extend(out.new_token_ids)
            if out.request_id not in first and out.new_token_ids:
                first[out.request_id] = time.perf_counter() - started
                if on_first is not None:
                    on_first(out.request_id)
            if out.finished:
                open_.discard(out.request_id)
    return first


def logprobs_round(bench: Bench, contestant: str, prompts: list[list[int]]) -> dict[str, Any]:
    args = bench.args
    engine = bench.engine(len(prompts) * (args.prompt_tokens + args.new_tokens), len(prompts))
    plain = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    asking = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=args.top)
    started = time.perf_counter()
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        asks = contestant == "logprobs5" or (contestant == "one_asks" and i == 0)
        engine.add_request(f"r{i}", prompt, asking if asks else plain)
        outputs[f"r{i}"] = []
    _drive(engine, outputs)
    wall = time.perf_counter() - started
    tokens = [outputs[f"r{i}"] for i in range(len(prompts))]
    return {"tokens_per_s": sum(map(len, tokens)) / wall, "wall_s": wall, "outputs": tokens}


def samples_round(bench: Bench, contestant: str, prompt: list[int]) -> dict[str, Any]:
    args = bench.args
    n = args.samples
    engine = bench.engine(n * (len(prompt) + args.new_tokens), n)
    params = [
        SamplingParams(
            max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=sample_seed(SEED, i)
        )
        for i in range(n)
    ]
    outputs: dict[str, list[int]] = {f"s{i}": [] for i in range(n)}
    engine.reset_step_log()
    started = time.perf_counter()
    if contestant == "n8":
        engine.add_request("s0", prompt, params[0])

        def start_the_rest(request_id: str) -> None:
            if request_id == "s0":
                for i in range(1, n):
                    engine.add_request(f"s{i}", prompt, params[i])

        first = _drive(engine, outputs, start_the_rest)
    else:
        for i in range(n):
            engine.add_request(f"s{i}", prompt, params[i])
        first = _drive(engine, outputs)
    wall = time.perf_counter() - started
    computed = sum(tokens for tokens, _ in engine.step_log)
    generated = sum(map(len, outputs.values()))
    return {
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "ttft_ms_p50": 1000.0 * statistics.median(first.values()),
        "ttft_ms_max": 1000.0 * max(first.values()),
        # Tokens run through the model that were not decodes of sampled tokens: the prompt's prefill.
        "prefill_tokens": computed - (generated - n),
        "outputs": [outputs[f"s{i}"] for i in range(n)],
    }


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def _alternate(
    contestants: tuple[str, ...],
    runs: int,
    play: Callable[[str], dict[str, Any]],
    show: Callable[[str, dict[str, Any]], str],
) -> dict[str, list[dict[str, Any]]]:
    """Round 0 (the warm-up, not kept) then `runs` rounds, each playing every contestant in turn."""
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in contestants}
    for round_ in range(runs + 1):
        for contestant in contestants:
            found = play(contestant)
            if round_:
                results[contestant].append(found)
            print(f"{show(contestant, found)} (round {round_})", file=sys.stderr)
    return results


def run_logprobs(bench: Bench, runs: int) -> tuple[dict[str, Any], bool]:
    args = bench.args
    prompts = make_prompts(args.requests, args.prompt_tokens, bench.vocab, bench.excluded, seed=0)
    results = _alternate(
        LOGPROB_CONTESTANTS,
        runs,
        lambda contestant: logprobs_round(bench, contestant, prompts),
        lambda contestant, found: f"logprobs {contestant}: {found['tokens_per_s']:.1f} tok/s",
    )
    reference = results["plain"][0]["outputs"]
    same = all(r["outputs"] == reference for rs in results.values() for r in rs)
    parity = _parity(bench, prompts, reference)
    rates = {c: [r["tokens_per_s"] for r in results[c]] for c in LOGPROB_CONTESTANTS}
    # Ratios of the same round (contestants ran back to back), then their median.
    ratio = statistics.median(a / b for a, b in zip(rates["logprobs5"], rates["plain"], strict=True))
    neighbour = statistics.median(a / b for a, b in zip(rates["one_asks"], rates["plain"], strict=True))
    record = {
        "workload": {
            "requests": args.requests,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
        },
        "top_logprobs": args.top,
        "tokens_per_s": {c: _spread(v) for c, v in rates.items()},
        "ratio_logprobs5_to_plain": ratio,
        "ratio_one_asks_to_plain": neighbour,
        "target": "logprobs5 >= 0.95 x plain",
        "met": ratio >= 0.95,
        "identical_tokens_across_contestants": same,
        "parity": parity.as_dict(),
    }
    return record, same and parity.ok


def run_samples(bench: Bench, runs: int) -> tuple[dict[str, Any], bool]:
    args = bench.args
    (prompt,) = make_prompts(1, args.sample_prompt_tokens, bench.vocab, bench.excluded, seed=1)
    results = _alternate(
        SAMPLE_CONTESTANTS,
        runs,
        lambda contestant: samples_round(bench, contestant, prompt),
        lambda contestant, found: f"samples {contestant}: {found['wall_s']:.2f} s",
    )
    reference = results["separate8"][0]["outputs"]
    same = all(r["outputs"] == reference for rs in results.values() for r in rs)
    walls = {c: [r["wall_s"] for r in results[c]] for c in SAMPLE_CONTESTANTS}
    ratio = statistics.median(a / b for a, b in zip(walls["n8"], walls["separate8"], strict=True))
    full_blocks = (len(prompt) - 1) // 16
    record = {
        "workload": {"prompt_tokens": len(prompt), "samples": args.samples, "new_tokens": args.new_tokens},
        "wall_s": {c: _spread(v) for c, v in walls.items()},
        "tokens_per_s": {c: _spread([r["tokens_per_s"] for r in results[c]]) for c in SAMPLE_CONTESTANTS},
        "ttft_ms_p50": {c: _spread([r["ttft_ms_p50"] for r in results[c]]) for c in SAMPLE_CONTESTANTS},
        "ttft_ms_max": {c: _spread([r["ttft_ms_max"] for r in results[c]]) for c in SAMPLE_CONTESTANTS},
        "prefill_tokens": {c: results[c][0]["prefill_tokens"] for c in SAMPLE_CONTESTANTS},
        "prompt_full_blocks": full_blocks,
        "ratio_wall_n8_to_separate8": ratio,
        "target": "n8 < separate8 in wall time, its prompt's full blocks prefilled once",
        "met": ratio < 1.0 and results["n8"][0]["prefill_tokens"] < len(prompt) + args.samples * 16,
        "identical_tokens_across_contestants": same,
    }
    return record, same


def _parity(bench: Bench, prompts: list[list[int]], outputs: list[list[int]]) -> ParityReport:
    import torch

    from bench.baselines import NaiveGenerate, load_hf_model

    count = min(bench.args.check_requests, len(prompts))
    hf = load_hf_model(bench.args.model, "cpu", torch.float32)
    reference = NaiveGenerate(hf, bench.args.new_tokens).reference(prompts[:count])
    return check_parity(outputs[:count], reference)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.requests, args.new_tokens, args.sample_prompt_tokens, args.runs = 8, 8, 64, 1
    elif args.runs < 3:
        print("bench.outputs: --runs must be >= 3 (or pass --smoke)", file=sys.stderr)
        return 2
    bench = Bench(args)
    provenance = start_provenance()
    run = run_logprobs if args.part == "logprobs" else run_samples
    record: dict[str, Any] = {"benchmark": f"outputs-{args.part}"}
    record[args.part], ok = run(bench, args.runs)
    record["provenance"] = finish_provenance(provenance)
    record["valid"] = not args.smoke and ok
    save_record(record, args.json or DEFAULT_JSON[args.part])
    print(args.part, {k: v for k, v in record[args.part].items() if k != "parity"})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
