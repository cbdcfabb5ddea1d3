"""`python -m bench.prefix_cache`: what prefix caching saves, cache on against cache off.

Workloads (`--workload shared|chat|all`), each on the in-process engine (bench/prefix_driver.py),
a fresh engine per run so no run starts with another's cache, contestants alternating
(on off on off ...) after a warm-up of each:

- shared: a 512-token system prompt and 64 users' short distinct questions submitted at once, 64
  new tokens each: TTFT p50 and p99 and generated tokens/s. Targets: TTFT p50 at least 4x lower and
  tokens/s at least 2x with the cache. Then, at one stream with the cache on, a request repeating a
  cached 1,100-token prefix against a 16-token prompt (alternated, 5 each): target first token in at
  most 2x the short prompt's time.
- chat: 16 conversations of 6 turns, each turn resending the history, 48 new tokens per turn:
  total time and TTFT per turn. Target: at least 2x less total time with the cache.

Greedy outputs of every run are checked against transformers' (the parity rule, bench/stats.py) on
the first --check-requests requests, and the cache-on outputs are compared with the cache-off ones.
The record and plot go to bench/results/. This module must not change the engine's settings beyond
enable_prefix_caching between contestants.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.prefix_driver import Timed, run_burst, run_conversations
from bench.prefix_workload import ChatTokens, questions
from bench.provenance import start_provenance
from bench.stats import DEFAULT_MODEL, ParityReport, check_parity, percentile, save_record

DEFAULT_JSON = Path("bench/results/prefix-cache-cpu.json")
CONTESTANTS = ("on", "off")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--workload", choices=("shared", "chat", "all"), default="all")
    parser.add_argument("--runs", type=int, default=3, help="timed rounds of both contestants (>= 3)")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--long-prefix-tokens", type=int, default=1100)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--chat-system-tokens", type=int, default=128)
    parser.add_argument("--chat-new-tokens", type=int, default=48)
    parser.add_argument("--check-requests", type=int, default=4, help="requests checked against transformers")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one run: the record is not valid")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    return parser


class Bench:
    """The loaded model, its tokenizer pieces and the transformers reference."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from bench.baselines import NaiveGenerate, load_hf_model
        from services.worker.model.loader import load_model

        torch.set_num_threads(args.threads)
        self.args = args
        self.loaded = load_model(args.model)
        self.chat = ChatTokens(args.model)
        self._hf = load_hf_model(args.model, "cpu", torch.float32)
        self._naive = NaiveGenerate
        self.parity = {name: ParityReport() for name in CONTESTANTS}

    def engine(self, contestant: str, tokens: int) -> Any:
        """A fresh engine whose KV cache holds `tokens` without any sharing (the same for both)."""
        from services.worker.engine.config import EngineConfig
        from services.worker.engine.engine import LLMEngine

        config = EngineConfig(
            max_num_seqs=max(self.args.users, self.args.conversations),
            num_blocks=-(-int(tokens * 1.1) // 16) + 8,
            enable_prefix_caching=contestant == "on",
        )
        return LLMEngine(self.loaded, config)

    def check(
        self, contestant: str, prompts: list[list[int]], outputs: list[list[int]], new_tokens: int
    ) -> None:
        count = min(self.args.check_requests, len(prompts))
        reference = self._naive(self._hf, new_tokens).reference(prompts[:count])
        self.parity[contestant].merge(check_parity(outputs[:count], reference))


def _ms(values: list[float], q: float) -> float:
    return 1000.0 * percentile(values, q)


def shared_round(bench: Bench, contestant: str, prompts: list[list[int]]) -> dict[str, Any]:
    new = bench.args.new_tokens
    engine = bench.engine(contestant, sum(len(p) + new for p in prompts))
    timed, wall = run_burst(engine, prompts, new)
    ttfts = [t.ttft_s for t in timed if t.ttft_s is not None]
    return {
        "ttft_ms_p50": _ms(ttfts, 50),
        "ttft_ms_p99": _ms(ttfts, 99),
        "tokens_per_s": sum(len(t.tokens) for t in timed) / wall,
        "wall_s": wall,
        "cached_prompt_tokens": sum(t.cached_tokens for t in timed),
        "prompt_tokens": sum(len(p) for p in prompts),
        "outputs": [t.tokens for t in timed],
    }


def one_stream(bench: Bench, reps: int) -> dict[str, Any]:
    """Cached 1,100-token prefix plus a new question, against a 16-token prompt, alternated."""
    chat, args = bench.chat, bench.args
    prefix = chat.system(args.long_prefix_tokens)
    engine = bench.engine("on", (args.long_prefix_tokens + 64) * (reps + 2))
    cold, _ = run_burst(engine, [prefix + chat.user_turn("Warm-up question?")], 1)
    cached, short = [], []
    for rep in range(reps):
        hit, _ = run_burst(engine, [prefix + chat.user_turn(f"Question {rep}: when do you open?")], 1)
        small = chat.encode(f"Hello number {rep}, tell me a short fact about the sea please now")[:16]
        alone, _ = run_burst(engine, [small], 1)
        cached.append(hit[0])
        short.append(alone[0])
    cached_ms = [1000.0 * (t.ttft_s or 0.0) for t in cached]
    short_ms = [1000.0 * (t.ttft_s or 0.0) for t in short]
    ratio = statistics.median(cached_ms) / statistics.median(short_ms)
    return {
        "prefix_tokens": len(prefix),
        "cold_ttft_ms": 1000.0 * (cold[0].ttft_s or 0.0),
        "cached_ttft_ms": cached_ms,
        "short_ttft_ms": short_ms,
        "short_prompt_tokens": len(short[0].prompt),
        "cached_prompt_tokens": [t.cached_tokens for t in cached],
        "ratio_cached_to_short": ratio,
        "target": "<= 2",
        "met": ratio <= 2.0,
    }


def chat_round(
    bench: Bench, contestant: str, openings: list[list[int]], turns: list[list[list[int]]]
) -> dict[str, Any]:
    args = bench.args
    longest = len(openings[0]) + sum(len(t) + args.chat_new_tokens + 4 for t in turns[0])
    engine = bench.engine(contestant, longest * len(openings) * 2)
    done, wall = run_conversations(engine, openings, turns, bench.chat.end_of_answer(), args.chat_new_tokens)
    per_turn = [
        statistics.median(1000.0 * (conv[k].ttft_s or 0.0) for conv in done) for k in range(args.turns)
    ]
    every: list[Timed] = [t for conv in done for t in conv]
    return {
        "total_s": wall,
        "ttft_ms_p50_per_turn": per_turn,
        "cached_prompt_tokens": sum(t.cached_tokens for t in every),
        "prompt_tokens": sum(len(t.prompt) for t in every),
        "prompts": [t.prompt for t in every],
        "outputs": [t.tokens for t in every],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.prefix_report import finish_record

    bench = Bench(args)
    provenance = start_provenance()
    record: dict[str, Any] = {
        "benchmark": "prefix_cache",
        "provenance": provenance,
        "options": vars(args).copy(),
    }
    record["options"] = {k: str(v) if isinstance(v, Path) else v for k, v in record["options"].items()}
    chat = bench.chat
    if args.workload in ("shared", "all"):
        system = chat.system(args.system_tokens)
        prompts = [system + chat.user_turn(q) for q in questions(args.users)]
        rounds: list[dict[str, Any]] = []
        for index in range(args.runs + 1):  # round 0 is the warm-up
            order = CONTESTANTS if index % 2 == 0 else CONTESTANTS[::-1]
            results = {name: shared_round(bench, name, prompts) for name in order}
            for name in CONTESTANTS:
                bench.check(name, prompts, results[name]["outputs"], args.new_tokens)
            rounds.append({"warmup": index == 0, **results})
        record["shared"] = {"rounds": rounds, "one_stream": one_stream(bench, 3 if args.smoke else 5)}
    if args.workload in ("chat", "all"):
        opening = chat.system(args.chat_system_tokens)
        openings = [opening] * args.conversations
        turns = [
            [chat.user_turn(q) for q in questions(args.turns, c * args.turns)]
            for c in range(args.conversations)
        ]
        rounds = []
        for index in range(args.runs + 1):
            order = CONTESTANTS if index % 2 == 0 else CONTESTANTS[::-1]
            results = {name: chat_round(bench, name, openings, turns) for name in order}
            for name in CONTESTANTS:
                bench.check(name, results[name]["prompts"], results[name]["outputs"], args.chat_new_tokens)
            rounds.append({"warmup": index == 0, **results})
        record["chat"] = {"rounds": rounds}
    record["parity"] = {name: report.as_dict() for name, report in bench.parity.items()}
    return finish_record(record, args.smoke)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.runs, args.users, args.system_tokens, args.new_tokens = 1, 8, 64, 8
        args.long_prefix_tokens, args.conversations, args.turns, args.chat_new_tokens = 128, 3, 2, 8
        args.chat_system_tokens = 48
    elif args.runs < 3:
        print("--runs must be >= 3 (bench/README.md rule 6); use --smoke for a quick try", file=sys.stderr)
        return 2
    record = run(args)
    save_record(record, args.json)
    from bench.prefix_report import table_text, write_plot

    write_plot(record, args.json.with_suffix(".png"))
    print(table_text(record))
    return 0 if record["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
