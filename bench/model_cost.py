"""`python -m bench.model_cost`: each fetched model's cost per token and its quality, side by side.

For every model of fetch-model's table (or those `--models` names), each fetched as float32 under
models/ or, for a model fetched as shipped there, models/float32/ (where `make bench-peer` puts its
conversion), in one run:
decode and prefill rates of our engine in float32 at one stream and at `--streams` streams
(bench/peer_engine.py's workload and timing, one process per run: `--prompt-tokens` seeded prompt
tokens, `--new-tokens` greedy tokens, EOS ignored, the same warm-up), in `--rounds` rounds whose order
of models alternates and flips, so each ratio compares runs made under the same conditions; and
beside them each model's perplexity on bench/data's fixed text, counted as bench.perplexity counts
it (the text `make bench-peer` scores). It writes bench/results/models-cpu.json; docs/models.md's table
is generated from it. This module measures and records; it must not fetch models (strata fetch-model
does) nor change them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.stats import save_record, summarize

MODELS_ROOT = Path("models")
# Where a float32 conversion lives when models/ holds the model as shipped (a GGUF folder).
FLOAT32_ROOT = MODELS_ROOT / "float32"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.model_cost", description=__doc__.split("\n")[0])
    p.add_argument("--models", help="comma-separated fetch-model names (default: every model of the table)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context", type=int, default=512, help="perplexity window, as bench.perplexity's")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.rounds < 5 and args.json is not None:
        p.error("--rounds must be >= 5 for a record (medians and spread); fewer only without --json")
    return args


def fetched_models(names: str | None) -> dict[str, Path]:
    """fetch-model name -> its float32 folder, for the named (or every) model of the table; refused,
    naming the fetch, when one is not fetched as float32: a rerun that quietly measured fewer models
    would shrink the docs' table."""
    from strata.cli.model_fetch import read_manifest
    from strata.cli.model_sources import SOURCES, source

    chosen = [source(name) for name in names.split(",")] if names else list(SOURCES.values())
    found: dict[str, Path] = {}
    missing: list[str] = []
    for entry in chosen:
        folders = (MODELS_ROOT / entry.folder, FLOAT32_ROOT / entry.folder)
        held = next((path for path in folders if read_manifest(path, entry, "float32") is not None), None)
        if held is None:
            missing.append(entry.name)
        else:
            found[entry.name] = held
    if missing:
        raise SystemExit(
            f"bench.model_cost: not fetched as float32 under {MODELS_ROOT}/ or {FLOAT32_ROOT}/: "
            f"{', '.join(missing)}: run `strata fetch-model --weights float32 --dest {FLOAT32_ROOT} "
            f"{' '.join(missing)}`, or name fewer with --models"
        )
    return found


def run_engine(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.peer_engine", "--model", str(model)]
    command += ["--npl", f"1,{args.streams}", "--prompt-tokens", str(args.prompt_tokens)]
    command += ["--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def weights_bytes(model: Path) -> int:
    return sum(path.stat().st_size for path in model.glob("*.safetensors"))


def summary(runs: list[dict[str, Any]], streams: str, key: str) -> dict[str, Any]:
    spread = summarize([float(run["streams"][streams][key]) for run in runs])
    return {"median": spread.median, "low": spread.low, "high": spread.high, "values": list(spread.values)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.perplexity import measure
    from bench.provenance import finish_provenance, start_provenance

    models = fetched_models(args.models)
    if not models:
        raise SystemExit("bench.model_cost: no model of the table is fetched: run `strata fetch-model NAME`")
    provenance = start_provenance(threads=args.threads)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in models}
    order = list(models)
    for number in range(args.rounds):
        for name in order if number % 2 == 0 else reversed(order):
            runs[name].append(run_engine(models[name], args))
            print(
                f"bench.model_cost: round {number + 1}/{args.rounds} {name} done", file=sys.stderr, flush=True
            )
    results: dict[str, Any] = {}
    for name, path in models.items():
        quality = measure(path, ["float32"], args.context)
        streams = {
            count: {
                key: summary(runs[name], count, key) for key in ("tok_s", "decode_tok_s", "prefill_tok_s")
            }
            for count in ("1", str(args.streams))
        }
        results[name] = {
            "folder": path.name,
            "weights_bytes": weights_bytes(path),
            "streams": streams,
            "perplexity": quality["paths"]["float32"]["perplexity"],
            "scored_tokens": quality["paths"]["float32"]["scored_tokens"],
            "text": quality["text"],
        }
    record = {
        "provenance": finish_provenance(provenance),
        "benchmark": "bench.model_cost",
        "workload": {
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "streams": [1, args.streams],
            "rounds": args.rounds,
            "dtype": "float32",
            "perplexity_context": args.context,
        },
        "models": results,
    }
    save_record(record, args.json)
    for name, result in results.items():
        one = result["streams"]["1"]["decode_tok_s"]["median"]
        many = result["streams"][str(args.streams)]["tok_s"]["median"]
        print(
            f"{name:30} 1 stream {one:7.2f} tok/s  {args.streams} streams {many:7.2f} tok/s  "
            f"perplexity {result['perplexity']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
