"""`python -m bench.memory_profile`: the memory a worker needs, by model, context and batch.

For each (model, max_model_len, max_num_seqs) it starts a fresh process (a process's high-water mark
and its allocator's pages outlive one profile, so two profiles in one process would not be
independent), loads the model as a worker does and runs the engine's own profiling step, then derives
the container memory limit to set: (peak + KV cache) / memory_utilization, for a cache of one
max_model_len request (the least that starts) and of every running slot at `--typical-tokens`. The
record feeds the table in docs/deployment.md and the manifests' limits (tests/unit/test_deploy_k8s.py
checks them against it). This module only measures and reports; it must not change any setting.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.provenance import finish_provenance, start_provenance
from bench.stats import save_record

MIB = 2**20
DEFAULT_MODELS = ("models/SmolLM2-135M-Instruct", "models/SmolLM2-135M-Instruct-int8:dynamic-int8")
DEFAULT_SHAPES = ("8192x64", "2048x64", "8192x16", "2048x16")

_CHILD = """
import json, sys
from services.worker.engine.config import EngineConfig
from services.worker.engine.memory_profile import profile_largest_step
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import load_model
path, quantization, context, seqs, batched = sys.argv[1:6]
loaded = load_model(path, quantization=quantization or None)
config = EngineConfig(max_num_seqs=int(seqs), max_num_batched_tokens=int(batched))
profile = profile_largest_step(loaded, config, int(context))
per_block = KVCache.bytes_per_block(loaded.config, config.block_size, loaded.dtype)
print(json.dumps({"weights": profile.weights_bytes, "baseline": profile.baseline_bytes,
                  "peak": profile.peak_bytes, "method": profile.method, "step": profile.step,
                  "kv_bytes_per_token": per_block // config.block_size,
                  "model_max_len": loaded.config.max_position_embeddings}))
"""


def profile_one(model: str, context: int, seqs: int, batched: int) -> dict[str, Any]:
    path, _, quantization = model.partition(":")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, path, quantization, str(context), str(seqs), str(batched)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def limits(row: dict[str, Any], utilization: float, typical_tokens: int) -> dict[str, int]:
    """The container limits, in MiB rounded up, at which this shape starts and serves every slot."""
    per_token = row["kv_bytes_per_token"]
    smallest = (row["peak"] + row["context"] * per_token) / utilization
    every_slot = (row["peak"] + row["seqs"] * typical_tokens * per_token) / utilization
    return {
        "limit_to_start_mib": -(-int(smallest) // MIB),
        "limit_every_slot_mib": -(-int(every_slot) // MIB),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="DIR or DIR:quantization (repeatable)")
    parser.add_argument("--shape", action="append", help="CONTEXTxSEQS, e.g. 8192x64 (repeatable)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--memory-utilization", type=float, default=0.8)
    parser.add_argument("--typical-tokens", type=int, default=1024, help="tokens a slot holds, larger limit")
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args(argv)
    provenance = start_provenance()
    rows = []
    for model in args.model or DEFAULT_MODELS:
        for shape in args.shape or DEFAULT_SHAPES:
            context, seqs = (int(part) for part in shape.split("x"))
            row = {"model": model, "context": context, "seqs": seqs, "batched": args.max_num_batched_tokens}
            row |= profile_one(model, context, seqs, args.max_num_batched_tokens)
            row |= limits(row, args.memory_utilization, args.typical_tokens)
            rows.append(row)
            print(
                f"{model:50} {context:>6} x {seqs:<3} peak {row['peak'] / MIB:7.0f} MiB  "
                f"limit to start {row['limit_to_start_mib']:6} MiB  every slot at {args.typical_tokens} "
                f"tokens {row['limit_every_slot_mib']:6} MiB",
                flush=True,
            )
    record = {
        "benchmark": "memory_profile",
        "provenance": finish_provenance(provenance),
        "memory_utilization": args.memory_utilization,
        "typical_tokens": args.typical_tokens,
        "rows": rows,
    }
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
