"""`python -m bench.large_linear`: one 64-stream decode step's projections three ways, for the GEMM lever.

At 64 streams a decode step is bound by its matmuls, and the engine's are `F.linear`, which calls MKL's
sgemm on the weight as stored, packing it afresh on every call. This times, for SmolLM2-135M's shapes
(bench/small_linear.py's weights, each on its own so they stream from memory), at each M of `--rows`:
`F.linear`; MKL's own pre-packed weights (`torch.ops.mkl._mkl_reorder_linear_weight` once, then
`_mkl_linear`, what Inductor's weight freezing uses); and oneDNN's (`to_mkldnn` weights, then
`mkldnn_linear`). Contestants alternate within each of `--runs` rounds; medians, GFLOP/s, and the
bytes each packed copy would add next to the stored weights. It only measures; the model uses none.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from bench.provenance import finish_provenance, start_provenance
from bench.small_linear import decode_weights, parse_args, time_alternated
from bench.stats import save_record

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable


def _contestants(weights: list[torch.Tensor], m: int) -> tuple[dict[str, Callable[[], None]], dict[str, int]]:
    inputs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
    onednn = [w.to_mkldnn() for w in weights]

    def stored() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    def mkl_packed() -> None:
        for w, p in zip(weights, packed, strict=True):
            torch.ops.mkl._mkl_linear(inputs[w.shape[1]], p, w, None, m)

    def onednn_blocked() -> None:
        for w, d in zip(weights, onednn, strict=True):
            torch._C._nn.mkldnn_linear(inputs[w.shape[1]].to_mkldnn(), d, None).to_dense()

    extra = {
        "mkl_packed": sum(p.numel() * p.element_size() for p in packed),
        "onednn": sum(w.numel() * w.element_size() for w in weights),
    }
    return {"f_linear": stored, "mkl_packed": mkl_packed, "onednn": onednn_blocked}, extra


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    provenance = start_provenance()
    # The decoder layers only: the vocabulary projection's logits rows are a separate, smaller M.
    weights = decode_weights(args.seed)[:-1]
    total_bytes = sum(w.numel() * w.element_size() for w in weights)
    results: dict[str, Any] = {}
    with torch.inference_mode():
        for m in args.rows:
            calls, extra = _contestants(weights, m)
            samples = time_alternated(calls, args.runs)
            flop = sum(2 * m * w.numel() for w in weights)
            row: dict[str, Any] = {
                name: {
                    "ms": statistics.median(values) * 1e3,
                    "spread_ms": [min(values) * 1e3, max(values) * 1e3],
                    "gflop_s": flop / statistics.median(values) / 1e9,
                }
                for name, values in samples.items()
            }
            for name in ("mkl_packed", "onednn"):
                row[name]["vs_f_linear"] = row["f_linear"]["ms"] / row[name]["ms"]
                row[name]["extra_bytes"] = extra[name]
            results[str(m)] = row
    return {
        "benchmark": "bench.large_linear",
        "valid": args.runs >= 3,
        "what": "one decode step's decoder projections of SmolLM2-135M (30 layers), each on its own weight",
        "weight_bytes": total_bytes,
        "by_rows": results,
        "provenance": finish_provenance(provenance),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args("bench.large_linear", __doc__, [16, 64], argv)
    record = run(args)
    save_record(record, args.json)
    weights_mib = record["weight_bytes"] / 2**20
    for m, row in record["by_rows"].items():
        shown = ", ".join(
            f"{name} {row[name]['ms']:.1f} ms ({row[name]['gflop_s']:.0f} GFLOP/s"
            + (
                f", {row[name]['vs_f_linear']:.2f}x, +{row[name]['extra_bytes'] / 2**20:.0f} MiB)"
                if name != "f_linear"
                else ")"
            )
            for name in ("f_linear", "mkl_packed", "onednn")
        )
        print(f"M={m}: {shown}; the stored weights are {weights_mib:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
