"""`python -m bench.serve_peer` (`make bench-serve-peer`): Strata's HTTP API against llama.cpp's
llama-server on the same weights, driven by the same client.

Strata is the stack of `--config` (bench/serve_peer.yaml: configs/local.yaml, what `make run`
starts, with a route that admits a 64-request burst and never falls back; or
bench/serve_peer_qwen.yaml, the Qwen2.5-Coder-0.5B Q4_K_M file as shipped), on free ports. llama.cpp
is llama-server on the same weights: the config's first worker's GGUF file when its folder holds
one, else its float32 checkpoint converted to GGUF F32 by llama.cpp's own converter
(bench/peer_setup.py builds and converts, once, into its cache), with `-np` = the largest
concurrency, `-c` = slots x (largest prompt + new tokens), continuous batching, and our worker's
thread count for `-t` and `-tb` (bench/serve_peer_llama.py). Both get /v1/completions requests of
text prompts of exactly the shape's token count under our tokenizer (bench/stack_prompts.py), greedy,
EOS ignored, streamed, through bench/http_driver.py's one httpx2 client from this process, a fresh
connection per request (llama-server closes a connection idle for 5 s, and one it closed as the
client took it from the pool failed the request: both sides now pay the same loopback connect
instead); the plan (shapes, concurrencies, alternation) is bench/serve_peer_plan.py's, the run
bench/serve_peer_run.py's, the figures bench/serve_peer_report.py's. All prompts are built before
either server starts. The record (bench/results/serve-peer-cpu.json) carries bench/provenance.py's
block, with llama.cpp's version, build flags and system_info under provenance.versions.llama_cpp.
This module wires the parts and writes the record; it must not time requests itself.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from bench.isa_probe import add_cap_option, apply_cap
from bench.peer_setup import build_info, prepare, prepare_file
from bench.provenance import REPOSITORY, finish_provenance, start_provenance
from bench.serve_peer_llama import LlamaServer, ServerOptions, probe_system_info, version
from bench.serve_peer_plan import LLAMA, STRATA, Level, Shape, plan_levels, prompt_seed, slot_tokens
from bench.serve_peer_report import summarize_levels, table
from bench.serve_peer_run import Outcome, Runner, Target, fresh_connection_client, run
from bench.session import spawned
from bench.stack_prompts import build_prompts, load_tokenizer
from bench.stats import save_record
from services.worker.model.gguf_file import find_gguf
from strata.settings import read_config

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from bench.stack_prompts import Prompt

CONFIG = Path(__file__).resolve().parent / "serve_peer.yaml"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_peer", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--json", type=Path, default=Path("bench/results/serve-peer-cpu.json"))
    parser.add_argument("--shapes", default="64x64,512x128", help="PROMPTxNEW token shapes")
    parser.add_argument("--concurrency", default="1,8,64", help="closed-loop streams per level")
    parser.add_argument("--min-requests", type=int, default=8, help="requests per level at least")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--warmup-streams", type=int, default=8, help="warm-up requests (and streams) per shape"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="allow --rounds 1; the record is not valid")
    add_cap_option(parser)
    args = parser.parse_args(argv)
    if args.rounds < 3 and not args.smoke:
        parser.error(f"--rounds {args.rounds}: at least 3 rounds (bench/README.md), or --smoke")
    try:
        args.shape_list = [Shape.parse(text) for text in args.shapes.split(",")]
        args.levels = plan_levels(
            args.shape_list, [int(c) for c in args.concurrency.split(",")], args.min_requests
        )
    except ValueError as exc:
        parser.error(str(exc))
    return args


class Prompts:
    """Every level's prompts by tag, built once (before the servers start) and then looked up."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._built: dict[str, list[Prompt]] = {}

    def __call__(self, tag: str, level: Level) -> list[Prompt]:
        seed = prompt_seed(tag, level)
        if seed not in self._built:
            self._built[seed] = build_prompts(
                self._tokenizer, level.requests, level.shape.prompt_tokens, seed
            )
        return self._built[seed]

    def prebuild(self, levels: list[Level], rounds: int, warmup_streams: int) -> None:
        for shape in dict.fromkeys(level.shape for level in levels):
            self("check", Level(shape, 1, 1))
            self("warm", Level(shape, warmup_streams, warmup_streams))
        for index in range(rounds):
            for level in levels:
                self(f"r{index}", level)


def strata_pids(llama_pid: int) -> list[int]:
    """The stack's processes: every child of this process but llama-server."""
    return [child.pid for child in psutil.Process().children(recursive=True) if child.pid != llama_pid]


async def _drive(targets: dict[str, Target], args: argparse.Namespace, prompts: Prompts) -> Outcome:
    most = max(level.concurrency for level in args.levels)
    async with fresh_connection_client(most) as client:
        runner = Runner(client, targets, args.timeout)
        return await run(runner, args.levels, args.rounds, prompts, args.warmup_streams)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    apply_cap(args.native_isa)
    import torch

    from services.worker.settings import WorkerSettings

    worker = WorkerSettings.load(args.config, index=0)
    threads = worker.threads or torch.get_num_threads()
    provenance = start_provenance(threads=threads)
    model_dir = Path(worker.model_path)
    model = str(read_config(args.config)["gateway"]["default_model"])
    print("bench.serve_peer: building the prompts", file=sys.stderr, flush=True)
    prompts = Prompts(load_tokenizer(model_dir))
    prompts.prebuild(args.levels, args.rounds, args.warmup_streams)
    gguf = find_gguf(model_dir)
    peer = prepare(model_dir, ("f32",)) if gguf is None else prepare_file(gguf)
    options = ServerOptions(
        peer.tool("llama-server"),
        peer.models["f32" if gguf is None else "gguf"],
        threads,
        max(level.concurrency for level in args.levels),
        slot_tokens(args.shape_list),
    )
    log_dir = args.log_dir or Path(f"/tmp/strata-bench-serve-peer-{int(time.time())}")
    log_dir.mkdir(parents=True, exist_ok=True)
    llama_cpp = {
        **build_info(peer),
        "server_version": version(options.binary),
        "system_info": probe_system_info(options, log_dir / "llama-server-probe.log"),
    }
    print(f"bench.serve_peer: starting both servers (logs in {log_dir})", file=sys.stderr, flush=True)
    with (
        spawned(args.config, log_dir) as endpoints,
        LlamaServer(options, log_dir / "llama-server.log") as llama,
    ):
        llama.wait_ready()
        targets = {
            STRATA: Target(
                f"http://{endpoints.http}/v1/completions", model, model, lambda: strata_pids(llama.pid)
            ),
            LLAMA: Target(f"{llama.url}/v1/completions", model, None, lambda: [llama.pid]),
        }
        outcome = asyncio.run(_drive(targets, args, prompts))
        command = llama.command
    provenance["versions"]["llama_cpp"] = llama_cpp
    record = build_record(args, outcome, command, options, model, finish_provenance(provenance))
    save_record(record, args.json)
    print(table(record["summary"]))
    print(f"wrote {args.json}")
    if not record["valid"]:
        print("bench.serve_peer: errors, miscounted tokens or --smoke: not a valid result", file=sys.stderr)
    return 0 if record["valid"] or args.smoke else 1


def build_record(
    args: argparse.Namespace,
    outcome: Outcome,
    command: list[str],
    options: ServerOptions,
    model: str,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    route = read_config(args.config)["gateway"]["routes"][0]
    errors = {c: sum(r["errors"] for runs in outcome.runs.values() for r in runs[c]) for c in (STRATA, LLAMA)}
    mismatches = {
        c: sum(r["token_mismatches"] for runs in outcome.runs.values() for r in runs[c])
        for c in (STRATA, LLAMA)
    }
    return {
        "benchmark": "serve_peer",
        "valid": not any(errors.values()) and not any(mismatches.values()) and not args.smoke,
        "smoke": args.smoke,
        "provenance": provenance,
        "workload": {
            "endpoint": "/v1/completions",
            "streamed": True,
            "greedy": True,
            "ignore_eos": True,
            "shapes": [
                {"prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens} for s in args.shape_list
            ],
            "levels": [
                {"level": lv.key, "concurrency": lv.concurrency, "requests": lv.requests}
                for lv in args.levels
            ],
            "rounds": args.rounds,
            "order": "every level on both back to back; Strata first in odd rounds, llama.cpp in even ones",
            "warmup": f"one untimed pass of each shape on both: {args.warmup_streams} requests at once",
        },
        "strata": {
            "config": str(_shown(args.config)),
            "model": model,
            "route": route,
            "admission_refusals_disabled": False,
            "worker_threads": options.threads,
        },
        "llama_cpp": {
            "command": [str(_shown(Path(part))) if part.startswith("/") else part for part in command],
            "gguf": options.model.name,
            "slots": options.slots,
            "context": options.slots * options.slot_tokens,
            "threads": options.threads,
        },
        "prompt_check": outcome.prompt_check,
        "errors": errors,
        "token_mismatches": mismatches,
        "summary": summarize_levels(args.levels, outcome.runs, outcome.pooled),
        "warmup": outcome.warmup,
        "rounds": outcome.rounds,
    }


def _shown(path: Path) -> Path:
    """A path as the record shows it: within the checkout relative to it, elsewhere its name alone
    (the peer's cache lives in a home directory that says nothing about the run)."""
    resolved = path.resolve()
    return resolved.relative_to(REPOSITORY) if resolved.is_relative_to(REPOSITORY) else Path(resolved.name)


if __name__ == "__main__":
    sys.exit(main())
