"""PNG plots of a `strata bench` record: throughput, time to first token and inter-token latency
against concurrency, with the in-process engine's figures as reference marks when they were measured;
and of a `strata bench --rate` record: goodput with fallback off and on, TTFT p99 against the SLO,
refusals by reason.

Reads only the record's summary fields (what bench/stack_report.py and bench/rate_report.py write), so
a plot can be redrawn from a saved JSON. Renders with matplotlib's Agg backend (no display); this
module must not measure anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from matplotlib.figure import Figure


def _series(levels: list[dict[str, Any]], metric: str, key: str) -> tuple[list[int], list[float]]:
    """Concurrencies and the metric's values, skipping levels where nothing was measured."""
    xs, ys = [], []
    for level in levels:
        value = level[metric][key] if key else level[metric]
        if value is not None:
            xs.append(level["concurrency"])
            ys.append(value)
    return xs, ys


def _panels() -> tuple[Figure, Any]:
    """A figure of three panels side by side, drawn with matplotlib's Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, 3, figsize=(15, 4.5))


def _save(figure: Figure, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_plots(record: dict[str, Any], path: Path) -> None:
    """Three panels side by side in one PNG at `path`."""
    levels: list[dict[str, Any]] = record["levels"]
    engine: dict[str, Any] | None = record.get("engine_baseline")
    concurrencies = [level["concurrency"] for level in levels]
    figure, (tps, ttft, itl) = _panels()

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
    title = (
        f"strata bench: {workload['model']}, {workload['prompt_tokens']} prompt + "
        f"{workload['new_tokens']} new tokens per request, {record['machine']['cpu_model']}"
    )
    _save(figure, title, path)


def write_rate_plot(record: dict[str, Any], path: Path) -> None:
    """`strata bench --rate`: goodput off vs on, accepted requests' TTFT p99 against the SLO, refusals."""
    phases = [record["phases"][name] for name in ("off", "on")]
    labels = ["fallback off", "fallback on"]
    colors = ["tab:gray", "tab:green"]
    workload, target = record["workload"], record["target"]
    figure, (goodput, ttft, refusals) = _panels()

    for x, phase in enumerate(phases):
        low, high = phase["goodput_tok_s_spread"]
        median = phase["goodput_tok_s"]
        goodput.bar(x, median, color=colors[x], yerr=[[median - low], [high - median]], capsize=6)
        goodput.plot([x] * len(phase["goodput_tok_s_runs"]), phase["goodput_tok_s_runs"], "k.")
    ratio = target["goodput_ratio"]
    shown = "unbounded" if ratio is None else f"{ratio:.2f}x"
    goodput.set_title(f"goodput (TTFT within SLO): on/off {shown}, target >= {target['goodput_ratio_min']}x")
    goodput.set_ylabel("output tokens / s")

    slo = workload["ttft_slo_ms"]
    for x, phase in enumerate(phases):
        runs = [value for value in phase["ttft_p99_ms_runs"] if value is not None]
        if phase["ttft_ms"]["p99"] is not None:
            ttft.bar(x, phase["ttft_ms"]["p99"], color=colors[x])
        ttft.plot([x] * len(runs), runs, "k.")
    ttft.axhline(slo, color="tab:red", linestyle="--", label=f"SLO {slo:.0f} ms")
    ttft.set_title("time to first token p99, accepted requests")
    ttft.set_ylabel("ms")
    ttft.legend(fontsize="small")

    reasons = sorted({reason for phase in phases for reason in phase["refusal_reasons"]})
    bottoms = [0.0, 0.0]
    for reason in reasons:
        counts = [phase["refusal_reasons"].get(reason, 0) for phase in phases]
        refusals.bar([0, 1], counts, bottom=bottoms, label=f"refused: {reason}")
        bottoms = [b + c for b, c in zip(bottoms, counts, strict=True)]
    served = [phase["fallback_served"] for phase in phases]
    refusals.bar([0, 1], served, bottom=bottoms, color="tab:green", alpha=0.5, label="served by the fallback")
    refusals.set_title(f"requests, all rounds (offered {phases[0]['offered']} per phase)")
    refusals.set_ylabel("requests")
    refusals.legend(fontsize="small")

    for axis in (goodput, ttft, refusals):
        axis.set_xticks([0, 1], labels)
        axis.grid(True, axis="y", alpha=0.3)
    title = (
        f"strata bench --rate {workload['rate_rps']:.2f}/s ({workload['arrival']}, "
        f"{workload['rate_source']}): {workload['model']} -> {workload['fallback_model'] or 'no fallback'}, "
        f"{workload['prompt_tokens']} + {workload['new_tokens']} tokens, {record['machine']['cpu_model']}"
    )
    _save(figure, title, path)
