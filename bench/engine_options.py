"""The command line of `python -m bench.engine`: its options, their defaults and their checks.

This module must not run anything: bench/engine.py runs what these options describe.
"""

from __future__ import annotations

import argparse
import os

from bench.baselines import DTYPES, RANDOM_ARCHS
from bench.stats import PARITY_TOP2_GAP, add_workload_arguments

# bfloat16 logits of magnitude 16-32 are spaced 0.125 apart: two correct bf16 programs disagree by
# a few such steps, so a bf16 tie is anything within 0.5 of the top.
BF16_TIE_GAP = 0.5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine",
        description="Our engine against transformers and against the matmul ceiling.",
    )
    add_workload_arguments(p)
    p.add_argument("--random-weights", choices=sorted(RANDOM_ARCHS), help="build a random-weight model")
    p.add_argument("--naive-requests", type=int, default=4, help="requests the naive rate is taken on")
    p.add_argument("--check-requests", type=int, help="requests checked against the reference (all)")
    p.add_argument(
        "--tie-gap",
        type=float,
        help=f"parity rule's tie gap (default {PARITY_TOP2_GAP} in float32, {BF16_TIE_GAP} in bfloat16)",
    )
    p.add_argument("--reference-batch", type=int, default=16, help="prompts per reference generate call")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, help="engine (and hf_cb) tokens per step")
    p.add_argument("--no-mixed", action="store_true", help="engine: no decodes mixed with prefill")
    p.add_argument("--skip-engine", action="store_true", help="baselines only; nominal ceiling schedule")
    p.add_argument("--no-asyncio", action="store_true", help="skip the asyncio event-loop lag run")
    p.add_argument(
        "--no-hf-cb",
        action="store_true",
        help="leave transformers continuous batching out: its manager thread keeps a second OpenMP team "
        "alive, which slows every other contestant on a machine with few cores",
    )
    p.add_argument("--ceiling-reps", type=int, default=3)
    p.add_argument(
        "--quantization",
        choices=["dynamic-int8", "int8", "nf4"],
        help="add a contestant `quantized`: the engine with these weights, held to no parity rule "
        "(quantization changes logits; tests/integration/test_fallback_model.py gates its quality)",
    )
    p.add_argument(
        "--compare-native",
        action="store_true",
        help="add a contestant `engine_torch_ops`: the same engine with the native CPU kernels off "
        "(torch's F.linear, gathered SDPA, rms_norm and rotary), to measure what the kernels buy",
    )
    p.add_argument("--smoke", action="store_true", help="allow --runs < 3; marks the record invalid")
    args = p.parse_args(argv)
    if args.runs < 3 and not args.smoke:
        p.error("--runs must be >= 3 (median and spread); --smoke allows fewer and marks the JSON invalid")
    if args.tie_gap is None:
        args.tie_gap = BF16_TIE_GAP if args.dtype == "bfloat16" else PARITY_TOP2_GAP
    if args.check_requests is None:
        args.check_requests = args.requests
    args.naive_requests = min(args.naive_requests, args.requests)
    args.check_requests = min(args.check_requests, args.requests)
    return args
