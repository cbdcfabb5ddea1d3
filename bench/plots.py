"""PNG plots of a `strata bench` record: throughput, time to first token and inter-token latency
against concurrency, with the in-process engine's figures as reference marks when they were measured.

Reads only the record's summary fields (what bench/stack.py writes), so a plot can be redrawn from a
saved JSON. Renders with matplotlib's Agg backend (no display); this module must not measure anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path


def _series(levels: list[dict[str, Any]], metric: str, key: str) -> tuple[list[int], list[float]]:
    """Concurrencies and the metric's values, skipping levels where nothing was measured."""
    xs, ys = [], []
    for level in levels:
        value = level[metric][key] if key else level[metric]
        if value is not None:
            xs.append(level["concurrency"])
            ys.append(value)
    return xs, ys


def write_plots(record: dict[str, Any], path: Path) -> None:
    """Three panels side by side in one PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels: list[dict[str, Any]] = record["levels"]
    engine: dict[str, Any] | None = record.get("engine_baseline")
    concurrencies = [level["concurrency"] for level in levels]
    figure, (tps, ttft, itl) = plt.subplots(1, 3, figsize=(15, 4.5))

    xs, ys = _series(levels, "output_tok_s", "")
    tps.plot(xs, ys, marker="o", label="stack (median of runs)")
    for level in levels:
        low, high = level["output_tok_s_spread"]
        tps.vlines(level["concurrency"], low, high, colors="tab:blue", alpha=0.4)
    if engine is not None:
        tps.plot(
            [engine["concurrency"]], [engine["tok_s"]], marker="*", markersize=12, linestyle="none",
            color="tab:red", label=f"in-process engine, {engine['requests']} at once",
        )  # fmt: skip
    tps.set_title("output throughput")
    tps.set_ylabel("tokens / s")

    for axis, metric, title in (
        (ttft, "ttft_ms", "time to first token"),
        (itl, "itl_ms", "inter-token latency"),
    ):
        for key, style in (("p50", "o-"), ("p99", "s--")):
            xs, ys = _series(levels, metric, key)
            axis.plot(xs, ys, style, label=f"stack {key}")
        axis.set_title(title)
        axis.set_ylabel("ms")
    if engine is not None and engine.get("ttft_p50_ms") is not None:
        ttft.plot(
            [1], [engine["ttft_p50_ms"]], marker="*", markersize=12, linestyle="none", color="tab:red",
            label="in-process engine p50, alone",
        )  # fmt: skip

    workload = record["workload"]
    for axis in (tps, ttft, itl):
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axis.set_xlabel("concurrent streams")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle(
        f"strata bench: {workload['model']}, {workload['prompt_tokens']} prompt + "
        f"{workload['new_tokens']} new tokens per request, {record['machine']['cpu_model']}"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
