"""Two checkouts of Strata, alternated through the same `strata bench` run: a change's cost, measured.

    python -m bench.before_after --before DIR --after DIR [--rounds 3] [--json PATH] [-- BENCH ARGS]

Each round runs `strata bench --spawn` once in each checkout (before, after; then after, before on the
next round, so drift hits both alike), each checkout with its own code on the path and its own
configs/local.yaml, the same bench arguments (default: `--concurrency 1,64`, three sweeps each), and
reads two figures from each record: output tokens per second at the highest concurrency (the median
of its sweeps) and TTFT p50 at one stream. The record holds every round's figures, their medians and
spreads, and the two ratios after / before over the medians. This module only runs and reads
`strata bench`: the measuring is bench/stack_run.py's, in each checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.provenance import finish_provenance, git_checkout, start_provenance
from bench.stats import save_record, summarize

DEFAULT_BENCH_ARGS = ("--concurrency", "1,64", "--no-progress")
MAIN = "import sys; from strata.cli import main; sys.exit(main(sys.argv[1:]))"


def run_bench(tree: Path, bench_args: list[str], json_path: Path) -> dict[str, Any]:
    """One `strata bench --spawn` in `tree`, with that tree's code first on the path; its record."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-c", MAIN, "bench", "--spawn", *bench_args, "--json", str(json_path)]
    print(f"before_after: {tree}: {' '.join(command[3:])}", file=sys.stderr, flush=True)
    subprocess.run(command, cwd=tree, env=env, check=True)
    record: dict[str, Any] = json.loads(json_path.read_text())
    return record


def commit_of(tree: Path) -> str:
    """The checkout's HEAD, with `+dirty` when its tracked files differ from it ("" outside git)."""
    head, dirty = git_checkout(tree)
    return head + ("+dirty" if dirty and head else "")


def figures(record: dict[str, Any]) -> dict[str, float]:
    """Output tok/s at the highest concurrency and TTFT p50 at one stream, from one bench record."""
    levels = {level["concurrency"]: level for level in record["levels"]}
    top = max(levels)
    if 1 not in levels:
        raise SystemExit("before_after: the bench arguments must include concurrency 1")
    return {
        "concurrency": top,
        "output_tok_s": levels[top]["output_tok_s"],
        "ttft_p50_ms_one_stream": levels[1]["ttft_ms"]["p50"],
    }


def spread(values: list[float]) -> dict[str, Any]:
    """The median, the min-max spread and every round's value."""
    summary = summarize(values)
    return {"median": summary.median, "spread": [summary.low, summary.high], "rounds": values}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.before_after",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--before", type=Path, required=True, help="the checkout before the change")
    parser.add_argument("--after", type=Path, required=True, help="the checkout after the change")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="where to write the record")
    parser.add_argument("bench_args", nargs="*", help="after --: arguments for strata bench")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error(f"--rounds {args.rounds}: at least 3 rounds, for a median and a spread")
    bench_args = list(args.bench_args) or list(DEFAULT_BENCH_ARGS)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    provenance = start_provenance()
    measured: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="strata-before-after-") as scratch:
        for round_index in range(args.rounds):
            order = ("before", "after") if round_index % 2 == 0 else ("after", "before")
            for name in order:
                path = Path(scratch) / f"{name}-{round_index}.json"
                measured[name].append(figures(run_bench(trees[name], bench_args, path)))
    result: dict[str, Any] = {
        "benchmark": "bench.before_after",
        "provenance": finish_provenance(provenance),
        "bench_args": bench_args,
        "trees": {name: str(path) for name, path in trees.items()},
        "commits": {name: commit_of(path) for name, path in trees.items()},
        "rounds": args.rounds,
    }
    for name, rows in measured.items():
        result[name] = {
            "output_tok_s": spread([row["output_tok_s"] for row in rows]),
            "ttft_p50_ms_one_stream": spread([row["ttft_p50_ms_one_stream"] for row in rows]),
            "concurrency": rows[0]["concurrency"],
        }
    before, after = result["before"], result["after"]
    result["ratios"] = {
        "output_tok_s_after_over_before": after["output_tok_s"]["median"] / before["output_tok_s"]["median"],
        "ttft_p50_one_stream_after_over_before": after["ttft_p50_ms_one_stream"]["median"]
        / before["ttft_p50_ms_one_stream"]["median"],
    }
    print(json.dumps(result, indent=2))
    save_record(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
