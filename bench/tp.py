"""`python -m bench.tp` (`make bench-tp`): the engine on one rank against the same engine over two
tensor-parallel ranks, on the same machine.

On `--model` (default SmolLM2-135M-Instruct), CPU, float32, prefix caching off: one engine in this
process with `--threads` threads, and one split over two ranks (this process and one it starts, gloo
over loopback) with `--threads` / 2 threads each, so both sides use the same cores. Two workloads,
each the two sides alternated within each of `--rounds` rounds, order flipped every round: one stream,
and `--streams` streams; `--prompt-tokens` random prompt tokens and `--new-tokens` greedy tokens each,
EOS ignored. Per run: generated tokens/s, engine steps, and for the two-rank side rank 0's seconds
in collectives (the plan's broadcast and the two all-reduces a layer, waiting for the other rank
included) per step. Two ranks on cores that share one memory bus are not expected to be faster: the
record says how much the split costs here, and how much of a step the communication is, which is what
a multi-GPU figure will be judged by. Then, with the engines closed, two fresh processes time the
collectives alone at the step's sizes (`vocabulary`): an all_reduce of a step's hidden rows, and, for
the choice of how to project to the vocabulary, rank 0 projecting whole rows against each rank
projecting half the vocabulary and an all_gather of the halves. It writes bench/results/tp-cpu.json
with bench/provenance.py's block.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.provenance import finish_provenance, start_provenance
from bench.stats import DEFAULT_MODEL, make_prompts, save_record, summarize

SIDES = ("one_rank", "two_ranks")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tp", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=2, help="threads of the one-rank side; each rank gets half")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--json", type=Path, default=Path("bench/results/tp-cpu.json"))
    args = p.parse_args(argv)
    if args.rounds < 5:
        p.error(f"--rounds {args.rounds}: ratios need at least 5 alternated rounds")
    if args.threads < 2 or args.threads % 2:
        p.error(f"--threads {args.threads}: an even count, split between the two ranks")
    return args


def engines(args: argparse.Namespace) -> dict[str, Any]:
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import LLMEngine
    from services.worker.model.loader import load_model
    from services.worker.model.ranks import RankSpec, load_tensor_parallel

    config = EngineConfig(max_num_seqs=max(args.streams, 1), enable_prefix_caching=False, num_blocks=512)
    spec = RankSpec(
        args.model, "cpu", torch.float32, "auto", 2, 120.0, start_timeout_s=600.0, threads=args.threads // 2
    )
    return {
        "one_rank": LLMEngine(load_model(args.model), config),
        "two_ranks": LLMEngine(load_tensor_parallel(spec), config),
    }


def run(side: str, engine: Any, prompts: list[list[int]], params: Any, threads: int) -> dict[str, Any]:
    from services.worker.model.ranks import collective_clock

    torch.set_num_threads(threads)
    clock = collective_clock(engine.runner.model)
    steps, seconds = engine.stats().num_steps, clock.seconds if clock else 0.0
    started = time.perf_counter()
    out = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    steps = engine.stats().num_steps - steps
    tokens = sum(len(ids) for ids in out)
    result: dict[str, Any] = {"tok_s": tokens / elapsed, "tokens": tokens, "steps": steps, "seconds": elapsed}
    if clock is not None:
        result["collective_ms_per_step"] = 1000 * (clock.seconds - seconds) / steps
    return result


def alternate(engines: dict[str, Any], prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from strata.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    threads = {"one_rank": args.threads, "two_ranks": args.threads // 2}
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for round_index in range(args.rounds):
        order = SIDES if round_index % 2 == 0 else SIDES[::-1]
        for side in order:
            runs[side].append(run(side, engines[side], prompts, params, threads[side]))
            print(
                f"tp: {len(prompts)} stream(s) round {round_index + 1} {side}: {runs[side][-1]}",
                file=sys.stderr,
            )
    ratios = [
        two["tok_s"] / one["tok_s"] for one, two in zip(runs["one_rank"], runs["two_ranks"], strict=True)
    ]
    out: dict[str, Any] = {
        side: {"tok_s": asdict(summarize([r["tok_s"] for r in runs[side]])), "runs": runs[side]}
        for side in SIDES
    }
    comm = [r["collective_ms_per_step"] for r in runs["two_ranks"]]
    step_ms = [1000 * r["seconds"] / r["steps"] for r in runs["two_ranks"]]
    return out | {
        "ratio": asdict(summarize(ratios)),
        "collective_ms_per_step": asdict(summarize(comm)),
        "two_rank_step_ms": asdict(summarize(step_ms)),
    }


def vocabulary(args: argparse.Namespace, rows: tuple[int, ...]) -> dict[str, Any]:
    """Median milliseconds, per row count, of the collectives and projections the vocabulary choice
    weighs, timed by two processes of their own (gloo over loopback, as the engine's ranks)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import spawn

    from services.worker.model.loader import load_model

    config = load_model(args.model).config
    results = mp.get_context("spawn").Manager().dict()
    with socket.socket() as probe:  # a free port for the two processes' store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shape = (port, config.hidden_size, config.vocab_size, args.threads // 2, rows)
    spawn(_time_collectives, args=(shape, results), nprocs=2, join=True)
    return dict(results)


def _time_collectives(rank: int, shape: tuple[int, int, int, int, tuple[int, ...]], results: Any) -> None:
    import statistics
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time, not in stubs

    port, hidden, vocab, threads, rows = shape
    torch.set_num_threads(threads)
    store = TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    head = torch.randn(vocab, hidden)

    def median_ms(fn: Any) -> float:
        for _ in range(5):
            fn()
        times = []
        for _ in range(50):
            started = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - started))
        return statistics.median(times)

    for count in rows:
        x = torch.randn(count, hidden)
        half = torch.empty(count, vocab // 2)
        parts = [torch.empty(count, vocab // 2) for _ in range(2)]
        figures = {
            "all_reduce_hidden_ms": median_ms(lambda x=x: dist.all_reduce(x)),
            "all_gather_half_vocab_ms": median_ms(lambda p=parts, h=half: dist.all_gather(p, h)),
            "project_whole_vocab_ms": median_ms(lambda x=x: torch.nn.functional.linear(x, head)),
            "project_half_vocab_ms": median_ms(lambda x=x: torch.nn.functional.linear(x, head[: vocab // 2])),
        }
        if rank == 0:
            results[str(count)] = figures
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    provenance = start_provenance(threads=args.threads)
    sides = engines(args)
    vocab = sides["one_rank"].model_config.vocab_size
    try:
        record: dict[str, Any] = {
            "benchmark": "tensor parallel: one rank against two on the same cores",
            "provenance": provenance,
            "workload": {
                "model": args.model.name,
                "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens,
                "rounds": args.rounds,
                "threads_one_rank": args.threads,
                "threads_per_rank": args.threads // 2,
            },
        }
        for name, count in (("one_stream", 1), ("many_streams", args.streams)):
            prompts = make_prompts(count, args.prompt_tokens, vocab, set(), seed=count)
            record[name] = alternate(sides, prompts, args) | {"streams": count}
    finally:
        sides["two_ranks"].close()
    record["vocabulary"] = vocabulary(args, (1, args.streams))
    finish_provenance(provenance)
    for name in ("one_stream", "many_streams"):
        part = record[name]
        print(
            f"tp: {part['streams']} stream(s): two ranks {part['ratio']['median']:.2f}x one "
            f"({part['ratio']['low']:.2f}-{part['ratio']['high']:.2f}); collectives "
            f"{part['collective_ms_per_step']['median']:.2f} of "
            f"{part['two_rank_step_ms']['median']:.2f} ms a step"
        )
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
