"""The server-level peer's figures: one level's from its requests, the rounds' summary, the table.

A level's throughput is the generated tokens (usage.completion_tokens of its completed requests) over
its wall time, first send to last event. Time to first token runs to the first chunk with text, as
both servers' clients see it; the inter-token latency is the gap between consecutive text chunks
(both servers send one chunk per token, which `chunks_per_token` shows), and the time per output
token is a request's (end - first token) / (tokens - 1). A request counts as an error when it failed
(HTTP status, a stream error, a transport exception), and as a token mismatch when its usage names
other than the shape's prompt tokens or new tokens, or (Strata) another model than the primary.
The summary gives, per level and contestant, the median and min-max over rounds of each figure, the
percentiles pooled over every round's requests, and Strata / llama.cpp per round and at the medians.
This module reduces; it must not send requests nor start anything.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from bench.serve_peer_plan import CONTESTANTS, LLAMA, STRATA
from bench.stats import percentile, summarize

if TYPE_CHECKING:
    from collections.abc import Sequence

    from bench.driver import RequestResult
    from bench.serve_peer_plan import Level

FIGURES = ("output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "tpot_ms_p50")


def _ms(values: Sequence[float], q: float) -> float | None:
    return 1000 * percentile(values, q) if values else None


def ttfts(results: Sequence[RequestResult]) -> list[float]:
    return [r.first_text_s for r in results if r.status == "OK" and r.first_text_s is not None]


def itls(results: Sequence[RequestResult]) -> list[float]:
    return [gap for r in results if r.status == "OK" for gap in r.itl_s]


def level_figures(
    results: Sequence[RequestResult], wall_s: float, level: Level, model: str | None
) -> dict[str, Any]:
    """One level's figures on one contestant; `model`: the name every response must carry (None: any)."""
    ok = [r for r in results if r.status == "OK"]
    shape = level.shape
    mismatched = [
        r
        for r in ok
        if r.usage_output_tokens != shape.new_tokens
        or r.usage_input_tokens != shape.prompt_tokens
        or (model is not None and r.model != model)
    ]
    tokens = sum(r.usage_output_tokens or 0 for r in ok)
    first = ttfts(ok)
    gaps = itls(ok)
    per_token = [
        (r.e2e_s - r.first_text_s) / (r.usage_output_tokens - 1)
        for r in ok
        if r.first_text_s is not None and r.usage_output_tokens and r.usage_output_tokens > 1
    ]
    chunks = sum(len(r.itl_s) + 1 for r in ok if r.first_text_s is not None)
    kinds = Counter(f"{r.status}: {r.message[:120]}" for r in results if r.status != "OK")
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": sum(kinds.values()),
        "error_kinds": dict(sorted(kinds.items())),
        "token_mismatches": len(mismatched),
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms_p50": _ms(first, 50),
        "ttft_ms_p99": _ms(first, 99),
        "itl_ms_p50": _ms(gaps, 50),
        "itl_ms_p99": _ms(gaps, 99),
        "tpot_ms_p50": _ms(per_token, 50),
        "chunks_per_token": chunks / tokens if tokens else None,
    }


def _spread(values: list[float]) -> dict[str, Any]:
    spread = summarize(values)
    return {"median": spread.median, "min": spread.low, "max": spread.high, "runs": list(spread.values)}


def contestant_summary(runs: list[dict[str, Any]], pooled: Sequence[RequestResult]) -> dict[str, Any]:
    """Medians and spreads over rounds of each figure, the pooled percentiles and the error totals."""
    out: dict[str, Any] = {}
    for name in FIGURES:
        values = [run[name] for run in runs if run[name] is not None]
        out[name] = _spread(values) if values else None
    first, gaps = ttfts(pooled), itls(pooled)
    out["pooled"] = {
        "requests": len(pooled),
        "ttft_ms_p50": _ms(first, 50),
        "ttft_ms_p99": _ms(first, 99),
        "itl_ms_p50": _ms(gaps, 50),
        "itl_ms_p99": _ms(gaps, 99),
    }
    out["errors"] = sum(run["errors"] for run in runs)
    out["token_mismatches"] = sum(run["token_mismatches"] for run in runs)
    return out


def summarize_levels(
    levels: list[Level],
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    pooled: dict[str, dict[str, list[RequestResult]]],
) -> dict[str, Any]:
    """Per level key: each contestant's summary, Strata / llama.cpp tokens/s (median and per round),
    and Strata minus llama.cpp TTFT p50 and ITL p50 at the medians (ms)."""
    summary: dict[str, Any] = {}
    for level in levels:
        key = level.key
        row: dict[str, Any] = {
            c: contestant_summary(runs[key][c], pooled[key][c]) for c in CONTESTANTS if runs[key][c]
        }
        if STRATA in row and LLAMA in row:
            ours, theirs = runs[key][STRATA], runs[key][LLAMA]
            row["strata_vs_llama_cpp_tok_s"] = _ratio(row, "output_tok_s")
            row["strata_vs_llama_cpp_tok_s_per_round"] = [
                a["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"] else None
                for a, b in zip(ours, theirs, strict=True)
            ]
            for name in ("ttft_ms_p50", "itl_ms_p50"):
                a, b = row[STRATA][name], row[LLAMA][name]
                row[f"strata_minus_llama_cpp_{name}"] = a["median"] - b["median"] if a and b else None
        summary[key] = row
    return summary


def _ratio(row: dict[str, Any], name: str) -> float | None:
    ours, theirs = row[STRATA][name], row[LLAMA][name]
    if not ours or not theirs or not theirs["median"]:
        return None
    return float(ours["median"] / theirs["median"])


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(summary: dict[str, Any]) -> str:
    """One line per level: tokens/s of both and their ratio, TTFT and ITL p50 of both (medians)."""
    lines = [
        f"{'level':<12} {'strata tok/s':>12} {'llama tok/s':>12} {'ratio':>6} "
        f"{'TTFT p50 ms (S / L)':>20} {'ITL p50 ms (S / L)':>19}"
    ]
    for key, row in summary.items():
        tok_s = [_cell(_median(row, c, "output_tok_s")) for c in CONTESTANTS]
        ttft = " / ".join(_cell(_median(row, c, "ttft_ms_p50")) for c in CONTESTANTS)
        itl = " / ".join(_cell(_median(row, c, "itl_ms_p50")) for c in CONTESTANTS)
        ratio = _cell(row.get("strata_vs_llama_cpp_tok_s"), 2)
        lines.append(f"{key:<12} {tok_s[0]:>12} {tok_s[1]:>12} {ratio:>6} {ttft:>20} {itl:>19}")
    return "\n".join(lines)


def _median(row: dict[str, Any], contestant: str, name: str) -> float | None:
    figure = row.get(contestant, {}).get(name)
    return None if figure is None else float(figure["median"])
