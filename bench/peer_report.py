"""bench.peer's summary: per comparison and stream count, medians, spreads and per-round ratios of the
combined, prefill and decode rates, with both sides' perplexities beside every ratio.

A comparison pairs one of our engine's contestants with one of llama.cpp's. "fastest-vs-q4_k_m"
pairs llama.cpp's Q4_K_M with whichever of our configurations has the higher median combined rate
at that stream count (named in the row): our float32 or int8 against its 4-bit file. "gguf-q8_0" and
"gguf-q4_k_m" pair llama.cpp with our engine serving llama.cpp's own file as stored, the same bytes
on both sides. The ratio is
ours over theirs at the medians; per-round ratios pair the two runs of the same round. This module
computes and formats; it must not run anything.
"""

from __future__ import annotations

import statistics
from typing import Any

METRICS = ("tok_s", "prefill_tok_s", "decode_tok_s")
# name: (our contestant, or None for the fastest of ours; llama.cpp's contestant)
COMPARISONS: dict[str, tuple[str | None, str]] = {
    "float32": ("engine/float32", "llama.cpp/f32"),
    "int8": ("engine/int8", "llama.cpp/q8_0"),
    "fastest-vs-q4_k_m": (None, "llama.cpp/q4_k_m"),
    "gguf-q8_0": ("engine/gguf-q8_0", "llama.cpp/q8_0"),
    "gguf-q4_k_m": ("engine/gguf-q4_k_m", "llama.cpp/q4_k_m"),
}
ENGINE_CONTESTANTS = ("engine/float32", "engine/int8")
# What "done" and the goal mean, engine / llama.cpp combined tok/s at the median.
TARGETS = {
    "float32@1": (0.9, 1.0),
    "float32@64": (1.0, 1.2),
    "int8@1": (0.8, None),
    "gguf-q8_0@1": (1.0, 1.2),
    "gguf-q8_0@64": (1.0, 1.3),
    "gguf-q4_k_m@1": (1.0, 1.2),
    "gguf-q4_k_m@64": (1.0, 1.3),
}


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def our_paths(contestant: str, streams: int, prompt_tokens: int) -> dict[str, str]:
    """Our perplexity paths (bench/perplexity.py) behind a contestant's workload, by phase: the int8
    fallback runs its weight-only kernel up to small_linear.MAX_ROWS rows a step and the dynamic path
    above; a GGUF projection its block kernels up to gguf_linear.NATIVE_MAX_ROWS rows, dequantize and
    GEMM above."""
    from services.worker.model.gguf_linear import NATIVE_MAX_ROWS
    from services.worker.model.small_linear import MAX_ROWS

    if contestant == "engine/float32":
        return {"prefill": "float32", "decode": "float32"}
    if contestant.startswith("engine/gguf-"):
        kind = contestant.removeprefix("engine/gguf-")
        prefill_rows = prompt_tokens * streams
        prefill = "small-batch" if prefill_rows <= NATIVE_MAX_ROWS else "whole-chunk"
        decode = "small-batch" if streams <= NATIVE_MAX_ROWS else "whole-chunk"
        return {"prefill": f"{kind}-stored-{prefill}", "decode": f"{kind}-stored-{decode}"}
    prefill = "int8-small-batch" if prompt_tokens <= MAX_ROWS else "int8-dynamic"
    decode = "int8-small-batch" if streams <= MAX_ROWS else "int8-dynamic"
    return {"prefill": prefill, "decode": decode}


def _series(rounds: list[dict[str, Any]], contestant: str, streams: str, metric: str) -> list[float]:
    return [r["runs"][contestant]["result"][streams][metric] for r in rounds]


def fastest(rounds: list[dict[str, Any]], streams: str) -> str:
    return max(ENGINE_CONTESTANTS, key=lambda c: statistics.median(_series(rounds, c, streams, "tok_s")))


def compare(rounds: list[dict[str, Any]], ours: str, theirs: str, streams: str) -> dict[str, dict[str, Any]]:
    rows = {}
    for metric in METRICS:
        mine, other = _series(rounds, ours, streams, metric), _series(rounds, theirs, streams, metric)
        per_round = [m / o for m, o in zip(mine, other, strict=True)]
        rows[metric] = {
            "engine": spread(mine),
            "llama_cpp": spread(other),
            "ratio_median": statistics.median(mine) / statistics.median(other),
            "ratio_per_round": per_round,
            "ratio_min": min(per_round),
            "ratio_max": max(per_round),
        }
    return rows


def summarize(
    rounds: list[dict[str, Any]], npl: list[int], prompt_tokens: int, perplexity: dict[str, Any]
) -> dict[str, Any]:
    """`perplexity` holds {"ours": {path: ppl}, "llama_cpp": {gguf type: ppl}}."""
    summary: dict[str, Any] = {}
    for name, (chosen, theirs) in COMPARISONS.items():
        for streams in map(str, npl):
            ours = chosen or fastest(rounds, streams)
            key = f"{name}@{streams}"
            paths = our_paths(ours, int(streams), prompt_tokens)
            gguf = theirs.split("/")[1]
            ratio = compare(rounds, ours, theirs, streams)
            target, goal = TARGETS.get(key, (None, None))
            summary[key] = {
                "engine": ours,
                "llama_cpp": theirs,
                **ratio,
                "perplexity": {
                    "engine": {
                        phase: {"path": p, "perplexity": perplexity["ours"][p]} for phase, p in paths.items()
                    },
                    "llama_cpp": {"type": gguf, "perplexity": perplexity["llama_cpp"][gguf]},
                },
                "flagged_rounds": sum(1 for r in rounds if r["flagged"]),
                "target": target,
                "goal": goal,
                "met": None if target is None else ratio["tok_s"]["ratio_median"] >= target,
            }
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"{'comparison':<22} {'engine':<15} {'tok/s ours':>10} {'theirs':>8} {'ratio':>6} "
        f"{'range':>11} {'prefill':>7} {'decode':>7}  perplexity ours / theirs"
    ]
    for key, row in summary.items():
        combined = row["tok_s"]
        ours = ", ".join(f"{v['perplexity']:.2f}" for v in row["perplexity"]["engine"].values())
        lines.append(
            f"{key:<22} {row['engine']:<15} {combined['engine']['median']:>10.1f} "
            f"{combined['llama_cpp']['median']:>8.1f} {combined['ratio_median']:>5.2f}x "
            f"{combined['ratio_min']:>5.2f}-{combined['ratio_max']:<5.2f} "
            f"{row['prefill_tok_s']['ratio_median']:>6.2f}x {row['decode_tok_s']['ratio_median']:>6.2f}x  "
            f"{ours} / {row['perplexity']['llama_cpp']['perplexity']:.2f}"
        )
    return "\n".join(lines)
