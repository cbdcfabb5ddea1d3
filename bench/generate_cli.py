"""`python -m bench.generate_cli`: `strata generate --local` on model folders, one stream, alternated.

What a user sees who runs one prompt from the command line: each round starts `strata generate
--local --model-dir FOLDER` as a new process for every folder in turn (the order flipped every other
round), with the same chat prompt, greedy, `--max-new-tokens` new tokens, and reads the line the
command prints when it finishes (prompt and new tokens, first-token and total seconds). The decode
rate is (new tokens - 1) / (total - first token): the rate at which the answer streams once it has
begun; the load time of the process and of the model is recorded beside it but not in the rate. By
default it compares the Qwen2.5-Coder-0.5B GGUF served as stored with its float32 conversion (`make
bench-peer` fetches both). Medians and min-max over `--rounds`; the ratio of each folder's median to
the last folder's. This module only times; it decides nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.provenance import finish_provenance, start_provenance
from bench.stats import save_record, summarize

DEFAULT_FOLDERS = [
    Path("models/Qwen2.5-Coder-0.5B-Instruct"),
    Path("models/float32/Qwen2.5-Coder-0.5B-Instruct"),
]
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
# strata/cli/local_generate.py's closing line.
SUMMARY = re.compile(
    r"\[(\d+) prompt tokens, (\d+) new, finish=(\w+), first token (\d+) ms, total ([\d.]+) s\]"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.generate_cli", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--folders", type=lambda s: [Path(v) for v in s.split(",")], default=DEFAULT_FOLDERS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def one_run(folder: Path, max_new_tokens: int) -> dict[str, Any]:
    """One `strata generate --local` process on `folder`: its summary line's figures."""
    strata = Path(sys.executable).with_name("strata")
    command = [str(strata), "generate", "--local", "--model-dir", str(folder), "--chat"]
    command += ["--max-new-tokens", str(max_new_tokens), PROMPT]
    started = time.perf_counter()
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    found = SUMMARY.search(done.stderr)
    if found is None:
        raise SystemExit(
            f"bench.generate_cli: no summary line from {' '.join(command)}:\n{done.stderr[-2000:]}"
        )
    new, first_ms, total = int(found[2]), int(found[4]), float(found[5])
    if new < 2:
        raise SystemExit(f"bench.generate_cli: {folder} answered {new} token(s): no decode rate to measure")
    return {
        "prompt_tokens": int(found[1]),
        "new_tokens": new,
        "finish": found[3],
        "first_token_ms": first_ms,
        "total_s": total,
        "process_s": wall,
        "decode_tok_s": (new - 1) / (total - first_ms / 1000),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for folder in args.folders:
        if not folder.is_dir():
            raise SystemExit(
                f"bench.generate_cli: no model folder {folder}: fetch it first (make bench-peer does)"
            )
    provenance = start_provenance(threads=len(os.sched_getaffinity(0)))
    runs: dict[str, list[dict[str, Any]]] = {str(folder): [] for folder in args.folders}
    for round_index in range(args.rounds):
        order = args.folders if round_index % 2 == 0 else list(reversed(args.folders))
        for folder in order:
            result = one_run(folder, args.max_new_tokens)
            runs[str(folder)].append(result)
            print(
                f"bench.generate_cli: round {round_index + 1} {folder}: {result['decode_tok_s']:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    summaries: dict[str, dict[str, Any]] = {}
    for folder, results in runs.items():
        rate = summarize([r["decode_tok_s"] for r in results])
        first = summarize([float(r["first_token_ms"]) for r in results])
        summaries[folder] = {
            "decode_tok_s": {"median": rate.median, "min": rate.low, "max": rate.high},
            "first_token_ms": {"median": first.median, "min": first.low, "max": first.high},
            "new_tokens": [r["new_tokens"] for r in results],
        }
    base = summaries[str(args.folders[-1])]["decode_tok_s"]["median"]
    for summary in summaries.values():
        summary["vs_last"] = summary["decode_tok_s"]["median"] / base
    record = {
        "benchmark": "bench.generate_cli",
        "valid": args.rounds >= 5,
        "what": "strata generate --local, one stream, greedy: decode rate once the answer has begun",
        "prompt": PROMPT,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "folders": summaries,
        "runs": runs,
        "provenance": finish_provenance(provenance),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"folders": [str(f) for f in args.folders]},
    }
    save_record(record, args.json)
    for folder, summary in summaries.items():
        decode = summary["decode_tok_s"]
        spread = f"{decode['min']:.1f}-{decode['max']:.1f}"
        print(f"{folder}: {decode['median']:.1f} tok/s ({spread}), {summary['vs_last']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
