"""What a decode costs an engine step, in prompt tokens of prefill: the figure behind decode_cost_tokens.

Times real engine steps on the model: for each batch of running decodes (1, 16, 32, 64 by default),
steps with only the decodes and steps that also prefill one new prompt of 64 to 448 tokens (the
prompt is aborted after its step, so the batch stays the same). Every shape is timed `--repeats`
times, shapes interleaved round by round, and the medians are fitted by least squares to
`step ms = fixed + a x decodes + b x prompt tokens`; `a / b` is what one decode costs in prompt
tokens. This module measures the engine alone; it must not start services.

    python -m bench.step_cost --model-dir models/SmolLM2-135M-Instruct --json bench/results/step-cost-cpu.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.provenance import finish_provenance, start_provenance
from bench.stats import save_record
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model.loader import load_model
from strata.sampling import SamplingParams


class _Steps:
    """An engine held at a batch of running decodes, with prompts of any size added for one step."""

    def __init__(self, engine: LLMEngine, seed: int) -> None:
        self.engine = engine
        self._rng = random.Random(seed)
        self._count = 0
        self._params = SamplingParams(max_new_tokens=4096, ignore_eos=True)

    def _add(self, tokens: int) -> str:
        self._count += 1
        name = f"r{self._count}"
        vocab = self.engine.model_config.vocab_size
        prompt = [self._rng.randrange(100, vocab) for _ in range(tokens)]
        self.engine.add_request(name, prompt, self._params)
        return name

    def hold(self, decodes: int) -> None:
        """Grow the batch to `decodes` running sequences, each past its prefill."""
        while self.engine.scheduler.num_running < decodes:
            self._add(4)
            self.engine.step()
        self.engine.step()

    def time_step(self, prefill: int) -> float:
        """Milliseconds of one step of the held batch plus a new prompt of `prefill` tokens (0: none)."""
        extra = self._add(prefill) if prefill else None
        started = time.perf_counter()
        self.engine.step()
        elapsed = (time.perf_counter() - started) * 1000.0
        stats = self.engine.stats()
        if stats.last_batch_tokens - stats.last_num_decodes != prefill:
            raise RuntimeError(
                f"a step meant to prefill {prefill} tokens computed "
                f"{stats.last_batch_tokens - stats.last_num_decodes}: the shape is not what it says"
            )
        if extra is not None:
            self.engine.abort(extra)
        return elapsed


def fit(samples: list[tuple[int, int, float]]) -> dict[str, float]:
    """Least squares of ms = fixed + a x decodes + b x prefill over (decodes, prefill, ms) samples."""
    rows = [(1.0, float(d), float(p)) for d, p, _ in samples]
    ys = [ms for _, _, ms in samples]
    # Normal equations (X^T X) w = X^T y, solved by Cramer's rule: three unknowns.
    xtx = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    xty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(3)]
    det = _det(xtx)
    if abs(det) < 1e-9:
        raise ValueError("the shapes do not determine the fit: vary both decodes and prefill")
    weights = []
    for column in range(3):
        swapped = [[*row[:column], xty[i], *row[column + 1 :]] for i, row in enumerate(xtx)]
        weights.append(_det(swapped) / det)
    fixed, per_decode, per_token = weights
    return {
        "fixed_ms": fixed,
        "ms_per_decode": per_decode,
        "ms_per_prefill_token": per_token,
        "decode_cost_tokens": per_decode / per_token,
    }


def _det(m: list[list[float]]) -> float:
    return (
        m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
        - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
        + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    provenance = start_provenance()
    loaded = load_model(args.model_dir)
    # One running slot more than the largest batch: the prompt added to a step must be admitted.
    config = EngineConfig(max_num_seqs=max(args.decodes) + 1, max_num_batched_tokens=4096)
    engine = LLMEngine(loaded, config)
    steps = _Steps(engine, args.seed)
    steps.hold(1)
    for _ in range(3):  # untimed: first steps allocate
        steps.time_step(max(args.prefill))
    times: dict[tuple[int, int], list[float]] = {}
    for decodes in args.decodes:
        steps.hold(decodes)
        for _ in range(args.repeats):
            for prefill in (0, *args.prefill):
                times.setdefault((decodes, prefill), []).append(steps.time_step(prefill))
    medians = [(d, p, statistics.median(values)) for (d, p), values in times.items()]
    return {
        "benchmark": "python -m bench.step_cost",
        "model_dir": str(args.model_dir),
        "fit": fit(medians),
        "shapes": [
            {"decodes": d, "prefill_tokens": p, "median_ms": m, "runs_ms": times[(d, p)]}
            for d, p, m in medians
        ],
        "provenance": finish_provenance(provenance),
        "config": {
            "repeats": args.repeats,
            "decodes": args.decodes,
            "prefill": args.prefill,
            "seed": args.seed,
        },
    }


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    parser.add_argument(
        "--decodes", type=_ints, default=[1, 16, 32, 64], help="batch sizes (default 1,16,32,64)"
    )
    parser.add_argument(
        "--prefill", type=_ints, default=[64, 128, 256, 448], help="prompt sizes added to a step"
    )
    parser.add_argument("--repeats", type=int, default=5, help="steps timed per shape (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the record here")
    args = parser.parse_args(argv)
    record = measure(args)
    save_record(record, args.json)
    fitted = record["fit"]
    print(
        f"step ms = {fitted['fixed_ms']:.1f} + {fitted['ms_per_decode']:.2f} x decodes + "
        f"{fitted['ms_per_prefill_token']:.3f} x prompt tokens: a decode costs "
        f"{fitted['decode_cost_tokens']:.2f} prompt tokens"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
