"""`python -m bench.gguf_linear`: a decode step's projections from GGUF blocks, the two paths apart.

For SmolLM2-135M's shapes (bench.small_linear's: 30 layers of fused qkv, o, fused gate_up and down,
plus the vocabulary projection), each weight quantized by the gguf package to each type of
`--types`, and each M of `--rows`, it times every projection in turn on its own weight (so they
stream from memory as in a real step) three ways: GgufLinear's native kernel (csrc/gguf_linear.cpp:
integer dot products of 8-bit activations up to 8 rows; above, the tiled integer GEMM where AVX-512
VNNI runs, else a tile buffer), its other path (the whole weight dequantized into the thread's
scratch, then torch's GEMM), and F.linear on the float32 weight for scale. M=512 is a prefill chunk
(the engine's default max_num_batched_tokens). Contestants alternate within each of `--runs` rounds;
medians and min-max are recorded. What it decides is where GgufLinear's NATIVE_MAX_ROWS belongs, and
whether the tiled kernel beats torch's GEMM at a prefill chunk; the module only times and decides
nothing.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from bench.provenance import finish_provenance, start_provenance
from bench.small_linear import decode_weights, parse_args, time_alternated
from bench.stats import save_record
from services.worker.model import gguf_linear, native
from services.worker.model.gguf_linear import GgufLinear
from services.worker.model.gguf_weight import GgufPart, GgufWeight

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

# Types every SmolLM2 shape holds whole blocks of (K = 576 is no multiple of the K types' 256).
DEFAULT_TYPES = "Q8_0,Q5_0,Q4_0"
DEFAULT_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512]


def stored(weights: list[torch.Tensor], qtype: GGMLQuantizationType) -> list[GgufLinear]:
    """Each float32 weight quantized to `qtype` by the gguf package, as a GgufLinear."""
    modules = []
    for weight in weights:
        blocks = np.ascontiguousarray(quants.quantize(weight.numpy(), qtype))
        modules.append(GgufLinear(GgufWeight([GgufPart(qtype, torch.from_numpy(blocks))])))
    return modules


def _contestants(
    modules: list[GgufLinear], weights: list[torch.Tensor], kernels: native.Library, m: int
) -> dict[str, Callable[[], None]]:
    inputs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}

    def kernel() -> None:
        for module in modules:
            module.from_blocks(kernels, inputs[module.in_features])

    def dequantize_gemm() -> None:
        for module in modules:
            module.from_dequantized(kernels, inputs[module.in_features])

    def float32() -> None:
        for weight in weights:
            F.linear(inputs[weight.shape[1]], weight)

    return {"native": kernel, "dequantize_gemm": dequantize_gemm, "float32_f_linear": float32}


def _summary(values: list[float]) -> dict[str, Any]:
    return {"ms": statistics.median(values) * 1e3, "spread_ms": [min(values) * 1e3, max(values) * 1e3]}


def run(args: argparse.Namespace, types: list[str]) -> dict[str, Any]:
    kernels = native.library()
    if kernels is None:
        raise SystemExit(f"bench.gguf_linear: the native kernels are off ({native.status()})")
    torch.set_num_threads(args.threads)
    provenance = start_provenance()
    weights = decode_weights(args.seed)
    results: dict[str, Any] = {}
    with torch.inference_mode():
        for name in types:
            modules = stored(weights, GGMLQuantizationType[name])
            by_rows: dict[str, Any] = {}
            for m in args.rows:
                samples = time_alternated(_contestants(modules, weights, kernels, m), args.runs)
                row = {contestant: _summary(values) for contestant, values in samples.items()}
                row["native_vs_dequantize_gemm"] = row["dequantize_gemm"]["ms"] / row["native"]["ms"]
                by_rows[str(m)] = row
                print(
                    f"bench.gguf_linear: {name} M={m} {row['native_vs_dequantize_gemm']:.2f}x",
                    file=sys.stderr,
                )
            results[name] = {
                "stored_bytes": sum(
                    part.data.numel() for module in modules for _, part in module.stored_parts()
                ),
                "by_rows": by_rows,
            }
    return {
        "benchmark": "bench.gguf_linear",
        "valid": args.runs >= 5,
        "what": "one decode step's projections of SmolLM2-135M (30 layers + lm_head) from GGUF blocks",
        "native_isa": native.isa(),
        "native_max_rows": gguf_linear.NATIVE_MAX_ROWS,
        "by_type": results,
        "provenance": finish_provenance(provenance),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"types": types},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args("bench.gguf_linear", __doc__, DEFAULT_ROWS, argv)
    record = run(args, DEFAULT_TYPES.split(","))
    save_record(record, args.json)
    print(f"{'type':>5} {'M':>4} {'native ms':>10} {'dequantize+GEMM ms':>19} {'float32 ms':>11}")
    for name, entry in record["by_type"].items():
        for m, row in entry["by_rows"].items():
            print(
                f"{name:>5} {m:>4} {row['native']['ms']:>10.2f} {row['dequantize_gemm']['ms']:>19.2f} "
                f"{row['float32_f_linear']['ms']:>11.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
