"""`python -m bench.small_linear`: one decode step's projections three ways, at small batch sizes.

For SmolLM2-135M's shapes (fused qkv, o, fused gate_up and down per layer, times 30 layers, plus the
576 x 49152 vocabulary projection) and each M of `--rows`, it times every layer's projections in
turn, each on its own weight (so they stream from memory as in a real step, not from cache):
`F.linear` on the [N, K] weight as stored; `x @ w_t` on a second, transposed [K, N] copy (the
layout that torch reads faster at M=1, at the cost of a second copy of every weight); and the
native kernel (services/worker/model/small_linear.py) on the stored weight. Contestants alternate
within each of `--runs` rounds; medians and min-max are reported with the effective GB/s, and the
record says what the transposed copy would cost in memory. This module only times; it decides
nothing about which path the model takes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from bench.provenance import finish_provenance, start_provenance
from bench.stats import save_record
from services.worker.model import native, small_linear

if TYPE_CHECKING:
    from collections.abc import Callable

# (N, K) of one SmolLM2-135M decoder layer's projections; the vocabulary projection separately.
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30
LM_HEAD = (49152, 576)


def decode_weights(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [shape for _ in range(LAYERS) for shape in LAYER_SHAPES] + [LM_HEAD]
    return [torch.randn(shape, generator=gen) * 0.02 for shape in shapes]


def _contestants(weights: list[torch.Tensor], m: int) -> dict[str, Callable[[], None]]:
    transposed = [w.t().contiguous() for w in weights]
    inputs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}

    def stored() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    def transposed_copy() -> None:
        for w in transposed:
            torch.matmul(inputs[w.shape[0]], w)

    def kernel() -> None:
        for w in weights:
            small_linear.linear(inputs[w.shape[1]], w)

    return {"f_linear": stored, "transposed_copy": transposed_copy, "native": kernel}


def parse_args(module: str, doc: str | None, rows: list[int], argv: list[str] | None) -> argparse.Namespace:
    """This benchmark's options: rows, rounds, threads, seed, record."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").split("\n")[0])
    p.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=rows)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def time_alternated(calls: dict[str, Callable[[], None]], runs: int) -> dict[str, list[float]]:
    """Each call once untimed (page faults, allocator, kernel choice), then `runs` rounds of all of them
    in turn: every call's seconds per round."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(runs):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - started)
    return samples


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    provenance = start_provenance()
    weights = decode_weights(args.seed)
    total_bytes = sum(w.numel() * w.element_size() for w in weights)
    results: dict[str, Any] = {}
    with torch.inference_mode():
        for m in args.rows:
            samples = time_alternated(_contestants(weights, m), args.runs)
            results[str(m)] = {
                name: {
                    "ms": statistics.median(values) * 1e3,
                    "spread_ms": [min(values) * 1e3, max(values) * 1e3],
                    "gb_s": total_bytes / statistics.median(values) / 1e9,
                }
                for name, values in samples.items()
            }
            row = results[str(m)]
            row["native_vs_f_linear"] = row["f_linear"]["ms"] / row["native"]["ms"]
            row["transposed_vs_f_linear"] = row["f_linear"]["ms"] / row["transposed_copy"]["ms"]
    return {
        "benchmark": "bench.small_linear",
        "valid": args.runs >= 3,
        "what": "one decode step's projections of SmolLM2-135M (30 layers + lm_head), each on its own weight",
        "weight_bytes": total_bytes,
        "transposed_copy_extra_bytes": total_bytes,
        "native_isa": native.isa(),
        "native_max_rows": small_linear.MAX_ROWS,
        "by_rows": results,
        "provenance": finish_provenance(provenance),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args("bench.small_linear", __doc__, [1, 2, 4, 8, 16, 64], argv)
    record = run(args)
    save_record(record, args.json)
    header = f"{'M':>4} {'F.linear ms':>12} {'x @ w_t ms':>11} {'native ms':>10} {'native GB/s':>12}"
    print(f"{header} {'speed-up':>9}")
    for m, row in record["by_rows"].items():
        print(
            f"{m:>4} {row['f_linear']['ms']:>12.2f} {row['transposed_copy']['ms']:>11.2f} "
            f"{row['native']['ms']:>10.2f} {row['native']['gb_s']:>12.1f} {row['native_vs_f_linear']:>8.2f}x"
        )
    extra = record["transposed_copy_extra_bytes"] / 2**20
    print(f"a transposed copy of every weight would cost {extra:.0f} MiB more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
