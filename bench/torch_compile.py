"""`python -m bench.torch_compile`: torch.compile's decode step at one stream against the native decode stack.

torch.compile (Inductor's CPU backend) is the other way to take the Python out of a small decode step.
It cannot trace the native kernels (ctypes calls), so its contestant runs the model with them off
(`native.set_enabled(False)`: torch's operators, the path a machine without a compiler takes),
compiled once with `dynamic=True` so that the growing context does not recompile it every step.
Both contestants run the same model: a 64-token prompt prefilled eagerly, then `--steps` decode steps
of one sequence (the model's forward and its vocabulary projection, greedy), timed per step, in
`--runs` alternated rounds, each round on a fresh copy of the prefilled cache. The compile's own
time (the first compiled step) is reported apart. It measures; it builds no setting.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.provenance import finish_provenance, start_provenance
from bench.stats import save_record


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.torch_compile", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=Path("bench/results/torch-compile-cpu.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    provenance = start_provenance()
    from torch._dynamo.utils import counters

    from services.worker.model import native
    from services.worker.model.attention import AttentionMetadata
    from services.worker.model.kv_cache import KVCache
    from services.worker.model.loader import load_model

    loaded = load_model(args.model)
    model, block = loaded.model, 16
    prompt = [100 + (i * 37) % 40000 for i in range(64)]
    blocks = -(-(len(prompt) + args.steps + 2) // block)
    table = [list(range(blocks))]
    prefilled = KVCache.allocate(loaded.config, blocks, block, torch.float32, "cpu")
    with torch.inference_mode():
        meta = AttentionMetadata.build([len(prompt)], [len(prompt)], table, block, "cpu", 0)
        first = int(
            model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), meta, prefilled))[
                -1
            ].argmax()
        )

    def step(forward: Any, cache: KVCache, token: int, position: int) -> int:
        meta = AttentionMetadata.build([1], [position + 1], table, block, "cpu", 1)
        hidden = forward(torch.tensor([token]), torch.tensor([position]), meta, cache)
        return int(model.compute_logits(hidden)[-1].argmax())

    def decode(forward: Any, kernels: bool) -> tuple[list[float], list[int]]:
        cache = KVCache(
            tuple(k.clone() for k in prefilled.keys),
            tuple(v.clone() for v in prefilled.values),
            prefilled.format,
        )
        previous = native.set_enabled(kernels)
        seconds, tokens, token = [], [], first
        try:
            with torch.inference_mode():
                for position in range(len(prompt), len(prompt) + args.steps):
                    started = time.perf_counter()
                    token = step(forward, cache, token, position)
                    seconds.append(time.perf_counter() - started)
                    tokens.append(token)
        finally:
            native.set_enabled(previous)
        return seconds, tokens

    compiled = torch.compile(model.forward, dynamic=True)
    compile_started = time.perf_counter()
    _, compiled_tokens = decode(compiled, kernels=False)
    compile_seconds = time.perf_counter() - compile_started
    contestants = {
        "native decode stack": (model.forward, True),
        "torch.compile, torch's operators": (compiled, False),
        "eager, torch's operators": (model.forward, False),
    }
    per_step: dict[str, list[float]] = {name: [] for name in contestants}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.runs):
        for name, (forward, kernels) in contestants.items():
            seconds, outputs[name] = decode(forward, kernels)
            per_step[name].append(1000.0 * statistics.median(seconds[2:]))
    medians = {name: statistics.median(values) for name, values in per_step.items()}
    record = {
        "benchmark": "torch_compile",
        "what": __doc__.split("\n")[0],
        "valid": args.runs >= 3,
        "provenance": finish_provenance(provenance),
        "workload": f"one sequence: 64-token prompt, {args.steps} greedy decodes; median ms a step per run",
        "ms_per_step_runs": per_step,
        "ms_per_step_median": medians,
        "compile_and_first_run_seconds": compile_seconds,
        "same_tokens_as_native": {
            name: tokens == outputs["native decode stack"] for name, tokens in outputs.items()
        },
        "compiled_tokens_match_first_run": compiled_tokens == outputs["torch.compile, torch's operators"],
        # How much of the step Dynamo captured: graphs compiled, and the breaks between them by reason.
        "dynamo_unique_graphs": counters["stats"]["unique_graphs"],
        "dynamo_graph_breaks": dict(counters["graph_break"]),
    }
    for name in contestants:
        print(
            f"{name:34} {medians[name]:6.2f} ms a step  runs {', '.join(f'{v:.2f}' for v in per_step[name])}"
        )
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    print(f"compile and first run: {compile_seconds:.1f} s; {graphs} graphs, {breaks} breaks")
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
