"""Benchmark bookkeeping: seeded prompts, run statistics and the table, parity, saving a record.

These are the pieces every benchmark shares so that all of them follow the rules in bench/README.md
the same way (a record's provenance is bench/provenance.py's). This module must not load models or
time anything itself; it only summarizes and compares what the contestants produced.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.provenance import check_provenance, finish_provenance

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

# tests/parity.py's TIE_GAP (a unit test keeps the two equal; bench must not import tests).
PARITY_TOP2_GAP = 1e-3
DEFAULT_MODEL = Path("models/SmolLM2-135M-Instruct")


@dataclass(frozen=True, slots=True)
class Spread:
    """The median and the min-max of one contestant's repeated measurements."""

    median: float
    low: float
    high: float
    values: tuple[float, ...]


def summarize(values: list[float]) -> Spread:
    if not values:
        raise ValueError("summarize needs at least one measurement")
    return Spread(statistics.median(values), min(values), max(values), tuple(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linearly interpolated between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile needs at least one value")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q={q} must be in [0, 100]")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


RATIOS = (
    ("engine", "hf_cb"),
    ("engine", "ceiling"),
    ("engine", "naive"),
    ("hf_cb", "naive"),
    ("hf_cb", "ceiling"),
)


def rates_record(rates: dict[str, list[float]]) -> dict[str, Any]:
    """`<name>_tok_s` (median), `<name>_spread` [min, max], `<name>_runs_tok_s`, and the ratios."""
    record: dict[str, Any] = {}
    for name, values in rates.items():
        spread = summarize(values)
        record[f"{name}_tok_s"] = spread.median
        record[f"{name}_spread"] = [spread.low, spread.high]
        record[f"{name}_runs_tok_s"] = list(spread.values)
    for name, base in RATIOS:
        if name in rates and base in rates:
            record[f"{name}_vs_{base}"] = record[f"{name}_tok_s"] / record[f"{base}_tok_s"]
    return record


def format_table(record: dict[str, Any]) -> str:
    """Contestant, tok/s median, spread, ratio to hf_cb, fraction of the ceiling; the physical limit."""
    names = [n for n in ("naive", "hf_cb", "engine", "engine_torch_ops", "ceiling") if f"{n}_tok_s" in record]
    hf, ceiling = record.get("hf_cb_tok_s"), record.get("ceiling_tok_s")
    lines = [f"{'contestant':<16} {'tok/s':>10} {'spread (min-max)':>22} {'vs hf_cb':>9} {'vs ceiling':>11}"]
    for name in names:
        median = record[f"{name}_tok_s"]
        low, high = record[f"{name}_spread"]
        vs_hf = f"{median / hf:.2f}x" if hf else "-"
        vs_ceiling = f"{median / ceiling:.1%}" if ceiling else "-"
        lines.append(f"{name:<16} {median:>10.1f} {f'{low:.1f}-{high:.1f}':>22} {vs_hf:>9} {vs_ceiling:>11}")
    limit = record.get("physical_limit_tok_s")
    if limit:
        machine = record["physical_limit"]["machine"]
        bandwidth, gflops = machine["read_bandwidth_gb_s"], machine["matmul_gflop_s"]
        engine = record.get("engine_tok_s")
        share = f"; the engine is at {engine / limit:.1%} of it" if engine else ""
        lines.append(
            f"physical limit {limit:.1f} tok/s (weights and KV over {bandwidth:.1f} GB/s, "
            f"FLOPs over {gflops:.0f} GFLOP/s){share}"
        )
    return "\n".join(lines)


def make_prompts(count: int, length: int, vocab_size: int, excluded: set[int], seed: int) -> list[list[int]]:
    """`count` prompts of `length` random token ids, none of them special, the same for every seed."""
    allowed = [t for t in range(vocab_size) if t not in excluded]
    if not allowed:
        raise ValueError(f"every id of the {vocab_size}-token vocabulary is excluded")
    rng = random.Random(seed)
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(count)]


# Reference logits kept per position: enough to see an n-way tie, small enough for long runs.
REFERENCE_TOP_K = 8


@dataclass(frozen=True, slots=True)
class Reference:
    """The reference's greedy tokens and, per position, its top-k token ids and logits (descending)."""

    tokens: list[list[int]]
    top_ids: list[list[list[int]]]
    top_logits: list[list[list[float]]]


@dataclass(slots=True)
class ParityReport:
    """How one contestant's outputs compare to the reference, request by request."""

    checked: int = 0
    identical: int = 0
    tie_divergences: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.checked > 0 and not self.failures

    def merge(self, other: ParityReport) -> None:
        self.checked += other.checked
        self.identical += other.identical
        self.tie_divergences += other.tie_divergences
        self.failures.extend(other.failures)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["failures"] = self.failures[:5]
        out["num_failures"] = len(self.failures)
        return out


def check_parity(
    outputs: list[list[int]], reference: Reference, tolerance: float = PARITY_TOP2_GAP
) -> ParityReport:
    """Apply the parity rule of tests/parity.py to the first len(reference.tokens) outputs.

    Identical greedy tokens pass; so does a run that first diverges where our pick's reference logit
    is within `tolerance` of the reference's top logit (for two candidates: the top-2 gap is under
    `tolerance` and ours is the runner-up; the top-k also covers exact n-way ties, which bfloat16
    logits have). The tokens after such a divergence continue a different text and are not
    compared. This is `assert_greedy_parity` reduced to what a benchmark can keep for many long
    requests (the reference's top-k per position, not its full logits), reporting instead of raising.
    """
    report = ParityReport()
    for index, (ours, ref) in enumerate(zip(outputs, reference.tokens, strict=False)):
        report.checked += 1
        if len(ours) != len(ref):
            report.failures.append(
                {"request": index, "reason": f"made {len(ours)} tokens, the reference {len(ref)}"}
            )
            continue
        position = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), None)
        if position is None:
            report.identical += 1
            continue
        ids, logits = reference.top_ids[index][position], reference.top_logits[index][position]
        ours_logit = logits[ids.index(ours[position])] if ours[position] in ids else None
        if ours_logit is not None and logits[0] - ours_logit < tolerance:
            report.tie_divergences += 1
            continue
        report.failures.append(
            {
                "request": index,
                "position": position,
                "ours": ours[position],
                "reference": ref[position],
                "reference_top_ids": ids[:3],
                "reference_top_logits": logits[:3],
                "ours_below_top": None if ours_logit is None else logits[0] - ours_logit,
            }
        )
    return report


def print_targets(benchmark: str, record: dict[str, Any]) -> None:
    """One line per target of the record's verdicts: its figure, and met or MISSED."""
    for line in record["targets"]:
        print(f"{benchmark}: {line['target']}: {line['figure']} ({'met' if line['met'] else 'MISSED'})")


def save_record(record: dict[str, Any], path: Path | None) -> None:
    """Write a benchmark's JSON record (bench/results/ by convention); nothing when path is None.

    The record's provenance gets its end load average here if the run did not fill it. A record
    without a valid provenance is still written (a long run is not thrown away) but named on stderr:
    tests/unit/test_record_provenance.py keeps it out of bench/results/.
    """
    provenance = record.get("provenance")
    if isinstance(provenance, dict) and provenance.get("load_average", {}).get("end") is None:
        finish_provenance(provenance)
    problems = check_provenance(record)
    if problems:
        print(f"save_record: {path} has no valid provenance: {'; '.join(problems)}", file=sys.stderr)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


async def probe_event_loop(stop: asyncio.Event, lags: list[float], tick_s: float = 0.001) -> None:
    """Sleep `tick_s` again and again until `stop` is set, recording how late each wake-up came.

    How late a timer fires is how long the loop waited for the GIL (or anything else) meanwhile.
    """
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(tick_s)
        lags.append(time.perf_counter() - started - tick_s)


def lag_summary(lags: list[float]) -> dict[str, float]:
    """p50, p99 and max of a probe's lags, in milliseconds."""
    ordered = sorted(lags)
    return {
        "loop_lag_ms_p50": 1000 * ordered[len(ordered) // 2],
        "loop_lag_ms_p99": 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "loop_lag_ms_max": 1000 * ordered[-1],
    }


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every engine benchmark shares: the model and the workload's shape."""
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per contestant (>= 3)")
    parser.add_argument("--json", type=Path, help="where to write the JSON record")
