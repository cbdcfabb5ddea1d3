"""The prefix-routing benchmark's summary, table and plot, from its rounds.

Per contestant the median and spread of the hit rate, TTFT p50 and the worst load share over the
runs; the targets judged on prefix routing's medians (met or missed, with the figure); the record is
void when any request failed. The plot draws only what the record holds; this module runs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bench.stats import summarize

if TYPE_CHECKING:
    from pathlib import Path

FIGURES = ("hit_rate", "ttft_ms_p50", "max_over_average_load")


def finish(record: dict[str, Any], smoke: bool, target_hit_rate: float, target_balance: float) -> None:
    rounds = record["rounds"]
    names = list(rounds[0])
    summary: dict[str, Any] = {}
    for name in names:
        summary[name] = {}
        for figure in FIGURES:
            values = [r[name][figure] for r in rounds if r[name][figure] is not None]
            if values:
                spread = summarize(values)
                summary[name][figure] = {"median": spread.median, "min": spread.low, "max": spread.high}
    record["summary"] = summary
    prefix = summary["prefix"]
    hit = prefix["hit_rate"]["median"]
    worst = prefix.get("max_over_average_load", {}).get("max")
    record["targets"] = {
        "hit_rate_prefix": {"median": hit, "target": f">= {target_hit_rate}", "met": hit >= target_hit_rate},
        "max_load_share_prefix": {
            "max_over_runs": worst,
            "target": f"<= {target_balance}",
            "met": worst is not None and worst <= target_balance,
        },
        "ttft_p50_least_loaded_over_prefix": [
            r["least_loaded"]["ttft_ms_p50"] / r["prefix"]["ttft_ms_p50"]
            for r in rounds
            if r["prefix"]["ttft_ms_p50"]
        ],
    }
    failed = any(r[name]["failures"] for r in rounds for name in names)
    record["valid"] = not smoke and not failed
    record["pass"] = record["valid"] and all(
        t["met"] for t in record["targets"].values() if isinstance(t, dict)
    )


def table_text(record: dict[str, Any]) -> str:
    lines = [f"prefix routing benchmark ({'valid' if record['valid'] else 'NOT valid'})"]
    for name, figures in record["summary"].items():
        lines.append(
            f"  {name}: "
            + ", ".join(f"{k} {v['median']:.3g} [{v['min']:.3g}-{v['max']:.3g}]" for k, v in figures.items())
        )
    lines.append(f"  targets: {record['targets']}")
    return "\n".join(lines)


def write_plot(record: dict[str, Any], path: Path) -> None:
    """Per contestant: hit rate, TTFT p50 and the worst load share over the average (medians)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = list(record["summary"])
    colors = ["tab:green", "tab:gray"]
    for axis, key, label in zip(
        axes, FIGURES, ("cache hit rate", "TTFT p50 ms", "max load / average"), strict=True
    ):
        values = [record["summary"][n].get(key, {}).get("median", 0.0) for n in names]
        axis.bar(range(len(names)), values, color=colors[: len(names)])
        axis.set_xticks(range(len(names)), names)
        axis.set_title(label)
        axis.grid(True, axis="y", alpha=0.3)
    axes[0].axhline(0.9, color="tab:red", linestyle="--", label="target 0.9")
    axes[2].axhline(1.3, color="tab:red", linestyle="--", label="target 1.3")
    axes[0].legend()
    axes[2].legend()
    verdict = "PASS" if record["pass"] else "targets missed or invalid"
    cpu = record["provenance"]["machine"]["cpu_model"]
    figure.suptitle(f"bench.prefix_routing ({verdict}): 2 replicas, {cpu}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
