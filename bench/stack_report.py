"""The rounds of `strata bench` reduced to medians and spreads, the verdict against the engine, the JSON
record and the printed table.

The record's layout: `workload` (model, prompt and new tokens, concurrencies, requests per level,
runs), `stack` (address, models served), `levels` (one entry per concurrency: `output_tok_s` median
with `_spread` and `_runs`, `requests_per_s`, `ttft_ms`/`itl_ms`/`e2e_ms` {p50, p95, p99} medians
over the runs, `refusals` and `errors` by status code, `token_mismatches`, and `runs`, each run's own
summary), `warmup`, `engine_baseline` and `target` (null without --engine-baseline), `valid` with
`invalid_reasons`, `voided` (requests failed or miscounted tokens: no figure counts), `smoke`,
`provenance` and `config`. This module only reduces and shapes what was measured; it must not measure,
nor talk to the stack.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from bench.provenance import finish_provenance
from bench.stats import summarize
from bench.summary import (
    counts_text,
    median_latencies,
    options_record,
    pair_text,
    pass_text,
    report_text,
    summed_counts,
)

if TYPE_CHECKING:
    import argparse
    from pathlib import Path

    from strata.v1 import gateway_pb2

# The targets: stack throughput at the top level against the engine's, TTFT p50 alone.
THROUGHPUT_RATIO_MIN = 0.85
TTFT_RATIO_MAX = 1.25
LATENCIES = ("ttft_ms", "itl_ms", "e2e_ms")


def acceptance(runs: list[dict[str, Any]]) -> float | None:
    """Speculative decoding's kept drafts over drafted tokens in these runs; None where none were drafted."""
    drafted = sum(run["draft_tokens"] for run in runs)
    return sum(run["accepted_draft_tokens"] for run in runs) / drafted if drafted else None


def aggregate_levels(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per level across rounds: tok/s median and spread, latency percentiles' medians, summed failures."""
    levels = []
    for position, first in enumerate(rounds[0]):
        runs = [summaries[position] for summaries in rounds]
        tok_s = summarize([run["output_tok_s"] for run in runs])
        levels.append(
            {
                "concurrency": first["concurrency"],
                "requests": first["requests"],
                "output_tok_s": tok_s.median,
                "output_tok_s_spread": [tok_s.low, tok_s.high],
                "output_tok_s_runs": list(tok_s.values),
                "requests_per_s": statistics.median(run["requests_per_s"] for run in runs),
                **{metric: median_latencies(runs, metric) for metric in LATENCIES},
                "refusals": summed_counts(runs, "refusals"),
                "errors": summed_counts(runs, "errors"),
                "token_mismatches": sum(run["token_mismatches"] for run in runs),
                "acceptance": acceptance(runs),
                "runs": runs,
            }
        )
    return levels


def judge(levels: list[dict[str, Any]], engine: dict[str, Any]) -> dict[str, Any]:
    """The two target ratios against the engine, per round and over the medians, with pass/fail."""
    by_concurrency = {level["concurrency"]: level for level in levels}
    top = by_concurrency.get(engine["concurrency"])
    verdict: dict[str, Any] = {
        "concurrency": engine["concurrency"],
        "throughput_ratio_min": THROUGHPUT_RATIO_MIN,
    }
    if top is not None:
        ratio = top["output_tok_s"] / engine["tok_s"]
        verdict["throughput_ratio"] = ratio
        verdict["throughput_ratio_runs"] = [
            s / e for s, e in zip(top["output_tok_s_runs"], engine["tok_s_runs"], strict=True)
        ]
        verdict["throughput_pass"] = ratio >= THROUGHPUT_RATIO_MIN
    alone = by_concurrency.get(1)
    verdict["ttft_ratio_max"] = TTFT_RATIO_MAX
    if alone is not None and alone["ttft_ms"]["p50"] is not None:
        ratio = alone["ttft_ms"]["p50"] / engine["ttft_p50_ms"]
        verdict["ttft_ratio"] = ratio
        verdict["ttft_ratio_runs"] = [
            run["ttft_ms"]["p50"] / e
            for run, e in zip(alone["runs"], engine["ttft_p50_ms_runs"], strict=True)
            if run["ttft_ms"]["p50"] is not None
        ]
        verdict["ttft_pass"] = ratio <= TTFT_RATIO_MAX
    checks = [verdict[k] for k in ("throughput_pass", "ttft_pass") if k in verdict]
    verdict["pass"] = bool(checks) and all(checks)
    return verdict


def engine_record(
    described: dict[str, Any],
    level: tuple[int, int],
    tok_s: list[float],
    ttft: list[list[float]],
    identical: int,
    compared: int,
) -> dict[str, Any]:
    """The engine's figures over the rounds; `level` is the stack level it ran (concurrency, requests)."""
    tps = summarize(tok_s)
    p50 = summarize([1000.0 * statistics.median(waits) for waits in ttft])
    return {
        "concurrency": level[0],
        "requests": level[1],
        "tok_s": tps.median,
        "tok_s_spread": [tps.low, tps.high],
        "tok_s_runs": list(tps.values),
        "ttft_requests": len(ttft[0]),
        "ttft_p50_ms": p50.median,
        "ttft_p50_ms_spread": [p50.low, p50.high],
        "ttft_p50_ms_runs": list(p50.values),
        # Greedy on the same ids, but batch composition can flip a near-tie: informational only.
        "outputs_identical_to_stack": identical,
        "outputs_compared": compared,
        **described,
    }


def _models(models: gateway_pb2.ListModelsResponse) -> list[dict[str, Any]]:
    return [
        {
            "name": m.name,
            "max_model_len": m.max_model_len,
            "ready_workers": m.ready_workers,
            "configured_workers": m.configured_workers,
            "fallback_model": m.fallback_model,
        }
        for m in models.models
    ]


def build_record(
    args: argparse.Namespace,
    *,
    address: str,
    provenance: dict[str, Any],
    models: gateway_pb2.ListModelsResponse,
    model_dir: Path,
    levels: list[dict[str, Any]],
    warmup: dict[str, Any] | None,
    requests_per_level: dict[int, int],
) -> dict[str, Any]:
    """Everything but the engine baseline and the verdict, which the caller adds when measured."""
    voiding, refused = [], []
    for level in levels:
        where = f"concurrency {level['concurrency']}"
        if level["errors"]:
            voiding.append(f"{where}: errors {level['errors']}")
        if level["token_mismatches"]:
            voiding.append(f"{where}: {level['token_mismatches']} requests with unexpected token counts")
        if level["refusals"]:
            refused.append(f"{where}: refusals {level['refusals']}")
    reasons = voiding + refused + (["--smoke run"] if args.smoke else [])
    return {
        "benchmark": "strata bench",
        "valid": not reasons,
        "invalid_reasons": reasons,
        "voided": bool(voiding),
        "smoke": args.smoke,
        "workload": {
            "model": args.model or models.default_model,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "concurrency": list(args.concurrency),
            "requests_per_level": {str(n): count for n, count in requests_per_level.items()},
            "runs": args.runs,
            "warmup_requests": args.warmup_requests,
            "loop": "closed: each stream sends its next request when the previous one has finished",
            "sampling": "greedy, ignore_eos: every request generates exactly new_tokens",
        },
        "stack": {
            "address": address,
            "spawned": args.spawn,
            "default_model": models.default_model,
            "models": _models(models),
            "model_dir": str(model_dir),
        },
        "levels": levels,
        "warmup": warmup,
        "engine_baseline": None,
        "target": None,
        "provenance": finish_provenance(provenance),
        "config": options_record(args),
    }


def _ratio_line(what: str, ratio: float, runs: list[float], bound: str, passed: bool) -> str:
    shown = ", ".join(f"{r:.3f}" for r in runs)
    return f"stack/engine {what}: {ratio:.3f} (runs {shown}; target {bound}): {pass_text(passed)}"


def _percent(share: float | None) -> str:
    """A share as a whole percentage; "-" where there is none (nothing drafted, or an older record)."""
    return "-" if share is None else f"{100 * share:.0f}%"


def format_report(record: dict[str, Any]) -> str:
    """The levels' table, then the engine baseline and the verdict when measured."""
    header = (
        f"{'streams':>7} {'reqs':>5} {'tok/s':>8} {'(min-max)':>15} {'req/s':>6} "
        f"{'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'E2E p50/p99 ms':>15} {'refused':>8} {'errors':>7} "
        f"{'drafts kept':>11}"
    )
    lines = [header]
    for level in record["levels"]:
        low, high = level["output_tok_s_spread"]
        lines.append(
            f"{level['concurrency']:>7} {level['requests']:>5} {level['output_tok_s']:>8.1f} "
            f"{f'{low:.1f}-{high:.1f}':>15} {level['requests_per_s']:>6.2f} "
            f"{pair_text(level['ttft_ms']):>16} {pair_text(level['itl_ms']):>15} "
            f"{pair_text(level['e2e_ms']):>15} {counts_text(level['refusals']):>8} "
            f"{counts_text(level['errors']):>7} {_percent(level.get('acceptance')):>11}"
        )
    engine = record["engine_baseline"]
    if engine is not None:
        low, high = engine["tok_s_spread"]
        t_low, t_high = engine["ttft_p50_ms_spread"]
        same, compared = engine["outputs_identical_to_stack"], engine["outputs_compared"]
        lines.append(
            f"in-process engine: {engine['requests']} requests, {engine['concurrency']} at a time, "
            f"{engine['tok_s']:.1f} tok/s "
            f"({low:.1f}-{high:.1f}); TTFT p50 alone {engine['ttft_p50_ms']:.1f} ms "
            f"({t_low:.1f}-{t_high:.1f}); outputs identical to the stack's: {same}/{compared}"
        )
    target = record["target"]
    if target is not None:
        if "throughput_ratio" in target:
            lines.append(
                _ratio_line(
                    f"throughput at {target['concurrency']} streams",
                    target["throughput_ratio"],
                    target["throughput_ratio_runs"],
                    f">= {target['throughput_ratio_min']}",
                    target["throughput_pass"],
                )
            )
        if "ttft_ratio" in target:
            lines.append(
                _ratio_line(
                    "TTFT p50 at 1 stream",
                    target["ttft_ratio"],
                    target["ttft_ratio_runs"],
                    f"<= {target['ttft_ratio_max']}",
                    target["ttft_pass"],
                )
            )
    return report_text(lines, record)
