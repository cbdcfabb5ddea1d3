"""The prefix-cache benchmark's summary, table and plot, from its rounds.

Per contestant the median and spread (min-max) of each figure over the timed rounds (the warm-up
excluded); per round the ratios off/on, so a noisy neighbour that slows a whole round cancels out,
and their median against each target (met or missed, with the figure). The cache-on outputs are
compared with the cache-off ones of the same round. Token lists are dropped from the saved record.
The plot draws only what the record holds. This module must not run anything.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from bench.provenance import finish_provenance
from bench.stats import summarize

if TYPE_CHECKING:
    from pathlib import Path

TARGETS = {
    "shared_ttft_p50_off_over_on": 4.0,
    "shared_tokens_per_s_on_over_off": 2.0,
    "chat_total_time_off_over_on": 2.0,
}


def _spread(values: list[float]) -> dict[str, float]:
    spread = summarize(values)
    return {"median": spread.median, "min": spread.low, "max": spread.high}


def _target(name: str, ratios: list[float]) -> dict[str, Any]:
    median = statistics.median(ratios)
    return {
        "ratios": ratios,
        "median": median,
        "target": f">= {TARGETS[name]:g}",
        "met": median >= TARGETS[name],
    }


def _equal_outputs(rounds: list[dict[str, Any]]) -> dict[str, int]:
    pairs = [(a, b) for r in rounds for a, b in zip(r["on"]["outputs"], r["off"]["outputs"], strict=True)]
    return {"requests": len(pairs), "identical_on_off": sum(a == b for a, b in pairs)}


def _strip(rounds: list[dict[str, Any]]) -> None:
    for entry in rounds:
        for name in ("on", "off"):
            entry[name].pop("outputs", None)
            entry[name].pop("prompts", None)


def finish_record(record: dict[str, Any], smoke: bool) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    if "shared" in record:
        shared = record["shared"]
        timed = [r for r in shared["rounds"] if not r["warmup"]]
        shared["equal_outputs"] = _equal_outputs(shared["rounds"])
        shared["summary"] = {
            name: {
                key: _spread([r[name][key] for r in timed])
                for key in ("ttft_ms_p50", "ttft_ms_p99", "tokens_per_s")
            }
            for name in ("on", "off")
        }
        targets["shared_ttft_p50_off_over_on"] = _target(
            "shared_ttft_p50_off_over_on", [r["off"]["ttft_ms_p50"] / r["on"]["ttft_ms_p50"] for r in timed]
        )
        targets["shared_ttft_p99_off_over_on"] = {
            "ratios": [r["off"]["ttft_ms_p99"] / r["on"]["ttft_ms_p99"] for r in timed]
        }
        targets["shared_tokens_per_s_on_over_off"] = _target(
            "shared_tokens_per_s_on_over_off",
            [r["on"]["tokens_per_s"] / r["off"]["tokens_per_s"] for r in timed],
        )
        stream = shared["one_stream"]
        targets["one_stream_cached_over_short"] = {
            "median": stream["ratio_cached_to_short"],
            "target": stream["target"],
            "met": stream["met"],
        }
        _strip(shared["rounds"])
    if "chat" in record:
        chat = record["chat"]
        timed = [r for r in chat["rounds"] if not r["warmup"]]
        chat["equal_outputs"] = _equal_outputs(chat["rounds"])
        chat["summary"] = {
            name: {
                "total_s": _spread([r[name]["total_s"] for r in timed]),
                "ttft_ms_p50_per_turn": [
                    statistics.median(r[name]["ttft_ms_p50_per_turn"][k] for r in timed)
                    for k in range(len(timed[0][name]["ttft_ms_p50_per_turn"]))
                ],
            }
            for name in ("on", "off")
        }
        targets["chat_total_time_off_over_on"] = _target(
            "chat_total_time_off_over_on", [r["off"]["total_s"] / r["on"]["total_s"] for r in timed]
        )
        _strip(chat["rounds"])
    record["targets"] = targets
    finish_provenance(record["provenance"])
    parity_ok = all(report["ok"] for report in record["parity"].values())
    record["valid"] = parity_ok and not smoke
    record["pass"] = record["valid"] and all(t.get("met", True) for t in targets.values())
    return record


def table_text(record: dict[str, Any]) -> str:
    lines = [f"prefix cache benchmark ({'valid' if record['valid'] else 'NOT valid'})"]
    for name, target in record["targets"].items():
        met = "" if "met" not in target else (" met" if target["met"] else " MISSED")
        lines.append(f"  {name}: {target['median'] if 'median' in target else target['ratios']}{met}")
    for workload in ("shared", "chat"):
        if workload in record:
            for name, summary in record[workload]["summary"].items():
                lines.append(f"  {workload} cache {name}: {summary}")
    lines.append(f"  parity: {record['parity']}")
    return "\n".join(lines)


def write_plot(record: dict[str, Any], path: Path) -> None:
    """Bars per contestant: shared TTFT p50/p99 and tokens/s; chat TTFT per turn and total time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("shared", "chat") if k in record]
    figure, axes = plt.subplots(len(panels), 2, figsize=(12, 4 * len(panels)), squeeze=False)
    colors = {"on": "tab:green", "off": "tab:gray"}
    for row, workload in enumerate(panels):
        summary = record[workload]["summary"]
        left, right = axes[row]
        if workload == "shared":
            for offset, name in enumerate(("off", "on")):
                values = [summary[name]["ttft_ms_p50"]["median"], summary[name]["ttft_ms_p99"]["median"]]
                left.bar(
                    [x + 0.4 * offset for x in (0, 1)], values, 0.4, color=colors[name], label=f"cache {name}"
                )
                right.bar([offset], [summary[name]["tokens_per_s"]["median"]], color=colors[name])
            left.set_xticks([0.2, 1.2], ["TTFT p50", "TTFT p99"])
            left.set_ylabel("ms (median of rounds)")
            right.set_xticks([0, 1], ["cache off", "cache on"])
            right.set_ylabel("generated tokens/s")
            left.set_title("shared 512-token system prompt, 64 users")
        else:
            for name in ("off", "on"):
                turns = summary[name]["ttft_ms_p50_per_turn"]
                left.plot(
                    range(1, len(turns) + 1), turns, marker="o", color=colors[name], label=f"cache {name}"
                )
            left.set_xlabel("turn")
            left.set_ylabel("TTFT p50 ms")
            left.set_title("multi-turn chat: TTFT per turn")
            right.bar(
                [0, 1],
                [summary[n]["total_s"]["median"] for n in ("off", "on")],
                color=[colors["off"], colors["on"]],
            )
            right.set_xticks([0, 1], ["cache off", "cache on"])
            right.set_ylabel("total seconds")
        left.legend()
        for axis in (left, right):
            axis.grid(True, axis="y", alpha=0.3)
    verdict = "PASS" if record["pass"] else "targets missed or invalid"
    figure.suptitle(f"bench.prefix_cache ({verdict}): {record['provenance']['machine']['cpu_model']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
