"""`python -m bench.peer`: our engine against llama.cpp on the same weights, text and CPU.

Both sides get the same workload on the same CPU and thread count: `--npl` parallel streams (1 and
64) of `--prompt-tokens` random prompt tokens and `--new-tokens` generated ones, greedy, and the
same warm-up (each shape once, untimed, in the same process; bench/peer_llama.py and
bench/peer_engine.py). Each run reports the combined rate (generated tokens over prefill plus decode
time) and its prefill and decode phases apart. Contestants: llama.cpp F32 against our float32;
llama.cpp Q8_0 against our int8 fallback (dynamic_int8.py: weight-only int8 at up to 8 rows a step,
dynamic int8 above); llama.cpp Q4_K_M (made by its own llama-quantize from the F32 file, or with
`--shipped-q4-k-m` the model's own file as shipped) against the
faster of ours at each stream count; and llama.cpp's Q8_0 and Q4_K_M files each against our engine
serving that same file as stored (bench/peer_setup.py's served_folder; its perplexity measured here
by bench/perplexity.py's stored paths). Rounds alternate and flip, their load is read and a loaded
round is repeated (bench/peer_rounds.py). Beside every ratio stand both sides' perplexities on
bench/data's text in the same windows: ours from bench/results/perplexity-cpu.json
(bench/perplexity.py), llama.cpp's by llama-perplexity here, after llama-tokenize confirms the token
ids are ours. The first round's float32 engine run is checked against transformers by the parity
rule. bench/peer_setup.py fetches, builds and converts the peer; this module runs it and reports,
and must not build anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import peer_llama
from bench.isa_probe import add_cap_option, apply_cap
from bench.peer_report import format_summary, summarize
from bench.peer_rounds import DEFAULT_MAX_REPEATS, DEFAULT_SETTLE_S, QUIET_LOAD, Rounds, wait_quiet
from bench.peer_setup import GGUF_TYPES, Peer, build_info, prepare, served_folder
from bench.perplexity import ids_digest, measure, read_text
from bench.provenance import finish_provenance, start_provenance
from bench.stats import DEFAULT_MODEL, save_record

LLAMA_CONTESTANTS = {f"llama.cpp/{kind}": kind for kind in GGUF_TYPES}
ENGINE_CONTESTANTS = {"engine/float32": None, "engine/int8": "dynamic-int8"}
# Our engine serving llama.cpp's own file as stored: name -> GGUF type.
GGUF_CONTESTANTS = {"engine/gguf-q8_0": "q8_0", "engine/gguf-q4_k_m": "q4_k_m"}
# The order of round 1 (later rounds flip it): the sides alternate.
CONTESTANTS = [
    "llama.cpp/f32",
    "engine/float32",
    "llama.cpp/q8_0",
    "engine/int8",
    "engine/gguf-q8_0",
    "llama.cpp/q4_k_m",
    "engine/gguf-q4_k_m",
]
GGUF_PATHS = ("stored-small-batch", "stored-whole-chunk")
PERPLEXITY_RECORD = Path("bench/results/perplexity-cpu.json")
PREPARED_SETTLE_S = 300.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--npl", type=lambda s: [int(v) for v in s.split(",")], default=[1, 64])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-repeats", type=int, default=DEFAULT_MAX_REPEATS)
    p.add_argument("--settle", type=float, default=DEFAULT_SETTLE_S, help="seconds to wait for load")
    p.add_argument("--repeat-budget", type=float, help="seconds all repeats may take together")
    p.add_argument("--perplexity-record", type=Path, default=PERPLEXITY_RECORD)
    p.add_argument(
        "--shipped-q4-k-m",
        type=Path,
        help="the model's Q4_K_M GGUF as shipped: both sides' Q4_K_M contestants serve it (default: "
        "llama-quantize's Q4_K_M of the F32 file)",
    )
    p.add_argument("--json", type=Path)
    add_cap_option(p)
    args = p.parse_args(argv)
    if args.rounds < 5 and args.json is not None:
        p.error("--rounds must be >= 5 for a record (medians and spread); fewer only without --json")
    return args


def run_engine(
    quantization: str | None, check: bool, args: argparse.Namespace, folder: Path | None = None
) -> dict[str, Any]:
    """One engine run in its own process: our checkpoint, or `folder` (a GGUF served as stored)."""
    command = [
        sys.executable,
        "-m",
        "bench.peer_engine",
        "--model",
        str(folder or args.model),
        "--vocab-model",
        str(args.model),
        "--npl",
        ",".join(map(str, args.npl)),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--new-tokens",
        str(args.new_tokens),
        "--threads",
        str(args.threads),
    ]
    if quantization:
        command += ["--quantization", quantization]
    if check:
        command.append("--check")
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def perplexities(peer: Peer, folders: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """Ours from the perplexity record, llama.cpp's measured here on the same text, window and ids."""
    if not args.perplexity_record.exists():
        raise SystemExit(
            f"bench.peer: no {args.perplexity_record}: run `python -m bench.perplexity --json "
            f"{args.perplexity_record}` first (make bench-peer does)"
        )
    ours = json.loads(args.perplexity_record.read_text())
    text = Path("bench/data") / ours["text"]["path"]
    llama_ids = peer_llama.token_ids(peer, read_text(text))
    context = ours["window"]["context"]
    theirs = {kind: peer_llama.perplexity(peer, kind, text, context, args.threads) for kind in peer.models}
    for kind, result in theirs.items():
        print(f"bench.peer: llama-perplexity {kind} {result['perplexity']:.4f}", file=sys.stderr, flush=True)
    served = {kind: measure(folder, list(GGUF_PATHS), context, text) for kind, folder in folders.items()}
    stored = {
        f"{kind}-{path}": result["perplexity"]
        for kind, measured in served.items()
        for path, result in measured["paths"].items()
    }
    same_ids = all(m["text"]["token_ids_sha256"] == ours["text"]["token_ids_sha256"] for m in served.values())
    return {
        "text": ours["text"],
        "window": ours["window"],
        "same_token_ids": ids_digest(llama_ids) == ours["text"]["token_ids_sha256"] and same_ids,
        "llama_cpp_tokens": len(llama_ids),
        "ours_record": {"path": str(args.perplexity_record), "commit": ours["provenance"]["commit"]},
        "ours": {name: path["perplexity"] for name, path in ours["paths"].items()} | stored,
        "llama_cpp": {kind: result["perplexity"] for kind, result in theirs.items()},
        "llama_cpp_detail": theirs,
    }


def progress(done: dict[str, Any], rounds: int) -> str:
    rates = ", ".join(
        f"{name} " + "/".join(f"{streams['tok_s']:.0f}" for streams in run["result"].values())
        for name, run in done["runs"].items()
    )
    load = done["load_average_start"][0]
    return f"bench.peer: round {done['round']}/{rounds} (load {load:.2f}, flagged {done['flagged']}): {rates}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_cap(args.native_isa)
    peer = prepare(args.model, GGUF_TYPES, args.shipped_q4_k_m)
    folders = {kind: served_folder(args.model, peer.models[kind]) for kind in GGUF_CONTESTANTS.values()}
    # Preparing may have built and converted the peer for many minutes: the record's start load must
    # be the machine's, not that build's, whose load decays from the 1-minute average in a few minutes.
    wait_quiet(lambda: QUIET_LOAD, PREPARED_SETTLE_S)
    provenance = start_provenance(threads=args.threads)
    quality = perplexities(peer, folders, args)
    system_info = next(iter(quality["llama_cpp_detail"].values()))["system_info"]
    provenance["versions"]["llama_cpp"] = {**build_info(peer), "system_info": system_info}
    parity: dict[str, Any] = {}

    def run_one(name: str) -> dict[str, Any]:
        if name in LLAMA_CONTESTANTS:
            kind = LLAMA_CONTESTANTS[name]
            return peer_llama.batched(peer, kind, args.npl, args.prompt_tokens, args.new_tokens, args.threads)
        if name in GGUF_CONTESTANTS:
            served: dict[str, Any] = run_engine(None, False, args, folders[GGUF_CONTESTANTS[name]])["streams"]
            return served
        check = not parity and ENGINE_CONTESTANTS[name] is None
        result: dict[str, Any] = run_engine(ENGINE_CONTESTANTS[name], check, args)["streams"]
        if check:
            parity.update({npl: entry.pop("parity") for npl, entry in result.items()})
        return result

    rounds = Rounds(CONTESTANTS, run_one, args.threads, args.max_repeats, args.settle, args.repeat_budget)
    kept = []
    for index in range(args.rounds):
        kept.append(rounds.round(index))
        print(progress(kept[-1], args.rounds), file=sys.stderr, flush=True)
    summary = summarize(kept, args.npl, args.prompt_tokens, quality)
    parity_ok = bool(parity) and all(report["ok"] for report in parity.values())
    record = {
        "provenance": finish_provenance(provenance),
        "benchmark": "bench.peer",
        "valid": parity_ok and quality["same_token_ids"],
        "summary": summary,
        "perplexity": {k: v for k, v in quality.items() if k != "llama_cpp_detail"},
        "parity": parity,
        "load": {
            "threshold": f"{QUIET_LOAD} + what our own earlier runs still add to the 1-minute average",
            "max_repeats": args.max_repeats,
            "settle_s": args.settle,
            "repeat_budget_s": args.repeat_budget,
            "repeat_seconds": rounds.repeat_seconds,
            "per_round": [
                {k: r[k] for k in ("round", "load_average_start", "load_average_end", "threshold", "flagged")}
                | {"repeats": len(r["discarded_attempts"])}
                for r in kept
            ],
        },
        "rounds": kept,
        "peer": {
            "models": {kind: path.name for kind, path in peer.models.items()},
            "batched_bench": f"-t {args.threads} -tb {args.threads} -b 2048 -ub 512 "
            f"-npp {args.prompt_tokens} -ntg {args.new_tokens} -npl {peer_llama.warmed_npl(args.npl)}",
        },
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    save_record(record, args.json)
    print(format_summary(summary))
    if not record["valid"]:
        print("bench.peer: PARITY OR TOKEN IDS FAILED: these times do not count", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
