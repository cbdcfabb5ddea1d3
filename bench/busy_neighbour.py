"""`python -m bench.busy_neighbour`: one stream of the primary, alone or next to a busy fallback.

The native decode stack (services/worker/model/decode_stack.py) keeps torch's threads spinning on its
own barrier between a step's kernels, then yields the core. Spinning is what collapsed the primary
next to a busy fallback when the whole process ran OMP_WAIT_POLICY=ACTIVE (bench/results/
fallback-cpu.json), so this measures that case: the float32 primary at 2 threads under PASSIVE, as
configs/local.yaml runs it, generating one stream of `--requests` requests back to back, with the
dynamic-int8 fallback at 1 thread in a process of its own looping 16-request generates the whole
time, or absent. Conditions alternate within each of `--runs` rounds; a fresh
neighbour starts for each busy condition. It only measures; it decides nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.provenance import finish_provenance, start_provenance
from bench.stats import save_record

# The primary's process runs with the workers' default policy; OpenMP reads it once, at torch's load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

CONDITIONS = ("alone, stack on", "alone, stack off", "busy neighbour, stack on", "busy neighbour, stack off")
NEIGHBOUR = """
import sys, torch
torch.set_num_threads(1)
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from strata.sampling import SamplingParams
engine = LLMEngine.from_model_dir(sys.argv[1], EngineConfig(num_blocks=256), quantization="dynamic-int8")
prompts = [[100 + (i * 31 + j) % 20000 for j in range(64)] for i in range(16)]
print("ready", flush=True)
while True:
    engine.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.busy_neighbour", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    p.add_argument("--fallback", type=Path, default=Path("models/SmolLM2-135M-Instruct-int8"))
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", type=Path, default=Path("bench/results/busy-neighbour-cpu.json"))
    return p.parse_args(argv)


def _neighbour(fallback: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": os.getcwd()}
    process = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR, str(fallback)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the neighbour exited with {process.wait()} before it was ready")
    return process


def _one_stream(engine: Any, prompts: list[list[int]]) -> float:
    from strata.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    started = time.perf_counter()
    for prompt in prompts:
        engine.generate([prompt], params)
    return 64 * len(prompts) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import LLMEngine
    from services.worker.model import decode_stack

    torch.set_num_threads(2)
    provenance = start_provenance()
    engine = LLMEngine.from_model_dir(args.model, EngineConfig(num_blocks=64, enable_prefix_caching=False))
    prompts = [[100 + (i * 37 + j) % 40000 for j in range(64)] for i in range(args.requests)]
    _one_stream(engine, prompts[:2])
    runs: dict[str, list[float]] = {name: [] for name in CONDITIONS}
    for _ in range(args.runs):
        for name in CONDITIONS:
            neighbour = _neighbour(args.fallback) if name.startswith("busy") else None
            previous = decode_stack.set_enabled(name.endswith("stack on"))
            try:
                runs[name].append(_one_stream(engine, prompts))
            finally:
                decode_stack.set_enabled(previous)
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    record = {
        "benchmark": "busy_neighbour",
        "what": __doc__.split("\n")[0],
        "valid": args.runs >= 3,
        "provenance": finish_provenance(provenance),
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "workload": f"{args.requests} requests of 64 prompt + 64 new tokens, one at a time, greedy",
        "runs_tok_s": runs,
        "median_tok_s": medians,
        "stack_on_vs_off_alone": medians[CONDITIONS[0]] / medians[CONDITIONS[1]],
        "stack_on_vs_off_next_to_busy": medians[CONDITIONS[2]] / medians[CONDITIONS[3]],
        "busy_vs_alone_stack_on": medians[CONDITIONS[2]] / medians[CONDITIONS[0]],
    }
    for name in CONDITIONS:
        print(f"{name:28} {medians[name]:6.1f} tok/s  runs {', '.join(f'{v:.1f}' for v in runs[name])}")
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
