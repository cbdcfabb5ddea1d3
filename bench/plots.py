"""PNG plots of a `strata bench` record: throughput, time to first token and inter-token latency
against concurrency, with the in-process engine's figures as reference marks when they were measured;
and of a `strata bench --rate` record, one column per offered rate: the admitted requests' TTFT p99
per phase and route against the SLO and 1.1 x the SLO, goodput with fallback off and on, refusals at
admission by reason; and of a `python -m bench.tenants` record, per contestant (fair queuing on,
off): the quiet tenant's admitted TTFT p99 against the SLO, each tenant's goodput, Jain's index.

Reads only the record's summary fields (what bench/stack_report.py, bench/rate_report.py and
bench/tenant_report.py write), so a plot can be redrawn from a saved JSON. Renders with matplotlib's
Agg backend (no display); this module must not measure anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from matplotlib.figure import Figure


_RATE_PHASES = ("off", "on")
_PHASE_COLORS = {"off": "tab:gray", "on": "tab:green"}
_FAIR_COLORS = {"off": "tab:gray", "on": "tab:green"}
_TENANT_COLORS = ("tab:orange", "tab:blue")


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
            color="tab:red", label=f"in-process engine, {engine['concurrency']} at a time",
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
        f"{workload['new_tokens']} new tokens per request, {record['provenance']['machine']['cpu_model']}"
    )
    _save(figure, title, path)


def _ttft_bars(axis: Any, entry: dict[str, Any], slo_ms: float, factor: float) -> None:
    """Admitted TTFT p99 per phase and route (routes that admitted none left out) against the SLO and
    its limit; a p99 that lands on a miss (no first token) is a hatched bar to the top, marked inf."""
    bars = [
        (f"{name}\n{route}", figures)
        for name in _RATE_PHASES
        for route, figures in entry["phases"][name]["routes"].items()
        if figures["admitted"]
    ]
    finite = [f["ttft_ms"]["p99"] for _, f in bars if f["ttft_ms"]["p99"] is not None]
    top = 1.3 * max([factor * slo_ms, *finite])
    for x, (_, figures) in enumerate(bars):
        value = figures["ttft_ms"]["p99"]
        color = "tab:green" if "fallback" in bars[x][0] else "tab:blue"
        if value is None:
            axis.bar(x, top, color="white", edgecolor=color, hatch="//")
            axis.text(x, 0.5 * top, f"inf\n{figures['no_first_token']} without\na first token", ha="center")
        else:
            axis.bar(x, value, color=color)
        runs = [v for v in figures["ttft_p99_ms_runs"] if v is not None]
        axis.plot([x] * len(runs), runs, "k.")
    axis.axhline(slo_ms, color="tab:orange", linestyle=":", label=f"SLO {slo_ms:.0f} ms")
    axis.axhline(factor * slo_ms, color="tab:red", linestyle="--", label=f"{factor:g} x SLO")
    axis.set_xticks(range(len(bars)), [label for label, _ in bars])
    axis.set_ylim(0, top)
    axis.set_ylabel("ms")
    axis.legend(fontsize="small")


def _goodput_bars(axis: Any, entry: dict[str, Any]) -> None:
    """Goodput per phase: the median, the min-max spread and every round."""
    for x, name in enumerate(_RATE_PHASES):
        phase = entry["phases"][name]
        low, high = phase["goodput_tok_s_spread"]
        median = phase["goodput_tok_s"]
        axis.bar(x, median, color=_PHASE_COLORS[name], yerr=[[median - low], [high - median]], capsize=6)
        axis.plot([x] * len(phase["goodput_tok_s_runs"]), phase["goodput_tok_s_runs"], "k.")
    target = entry["target"]
    ratio = target["goodput_ratio"]
    shown = "unbounded" if ratio is None else f"{ratio:.2f}x"
    axis.set_title(f"goodput (TTFT within SLO): on/off {shown}, target >= {target['goodput_ratio_min']}x")
    axis.set_xticks(range(len(_RATE_PHASES)), [f"fallback {name}" for name in _RATE_PHASES])
    axis.set_ylabel("output tokens / s")


def _refusal_bars(axis: Any, entry: dict[str, Any], colors: dict[str, Any]) -> None:
    """Refusals at admission per phase, all rounds, stacked by the reason their message names."""
    phases = [entry["phases"][name] for name in _RATE_PHASES]
    bottoms = [0.0] * len(phases)
    for reason, color in colors.items():
        counts = [phase["refusal_reasons"].get(reason, 0) for phase in phases]
        if any(counts):
            axis.bar(range(len(phases)), counts, bottom=bottoms, color=color, label=reason)
            bottoms = [b + c for b, c in zip(bottoms, counts, strict=True)]
    axis.set_title(
        f"refused at admission, all rounds ({entry['arrivals_per_phase']} arrivals per phase and round)"
    )
    axis.set_xticks(range(len(phases)), [f"fallback {name}" for name in _RATE_PHASES])
    axis.set_ylabel("requests")
    if any(bottoms):
        axis.legend(fontsize="small")


def write_rate_plot(record: dict[str, Any], path: Path) -> None:
    """`strata bench --rate`: one column per rate; admitted TTFT p99 per phase and route against the
    SLO, goodput per phase, refusals at admission by reason."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates, workload = record["rates"], record["workload"]
    figure, axes = plt.subplots(3, len(rates), figsize=(6 * len(rates), 13), squeeze=False)
    reasons = sorted({r for e in rates for n in _RATE_PHASES for r in e["phases"][n]["refusal_reasons"]})
    palette = plt.get_cmap("tab10")
    colors = {reason: palette(index % 10) for index, reason in enumerate(reasons)}
    for column, entry in enumerate(rates):
        ttft, goodput, refusals = axes[:, column]
        target = entry["target"]
        _ttft_bars(ttft, entry, target["ttft_slo_ms"], target["ttft_p99_slo_factor"])
        ttft.set_title(
            f"{entry['rate_rps']:.2f} req/s ({entry['rate_source']}), rate "
            f"{'PASS' if target['pass'] else 'FAIL'}: admitted TTFT p99"
        )
        _goodput_bars(goodput, entry)
        _refusal_bars(refusals, entry, colors)
        for axis in (ttft, goodput, refusals):
            axis.grid(True, axis="y", alpha=0.3)
    title = (
        f"strata bench --rate ({workload['arrival']}): {workload['model']} -> "
        f"{workload['fallback_model'] or 'no fallback'}, {workload['prompt_tokens']} + "
        f"{workload['new_tokens']} tokens, {record['provenance']['machine']['cpu_model']}"
    )
    _save(figure, title, path)


def _tenant_ttft_bars(axis: Any, record: dict[str, Any]) -> None:
    """The quiet tenant's admitted TTFT p99 per contestant (median, every round) against the SLO; a
    median landing on a miss is a hatched bar to the top, marked inf."""
    slo = record["workload"]["ttft_slo_ms"]
    contestants = record["contestants"]
    finite = [v for c in contestants.values() for v in c["quiet_admitted_ttft_p99_ms_runs"] if v is not None]
    top = 1.3 * max([slo, *finite])
    for x, (name, contestant) in enumerate(contestants.items()):
        value = contestant["quiet_admitted_ttft_p99_ms"]
        if value is None:
            axis.bar(x, top, color="white", edgecolor=_FAIR_COLORS[name], hatch="//")
            axis.text(x, 0.5 * top, "inf", ha="center")
        else:
            axis.bar(x, value, color=_FAIR_COLORS[name])
        runs = [v for v in contestant["quiet_admitted_ttft_p99_ms_runs"] if v is not None]
        axis.plot([x] * len(runs), runs, "k.")
    axis.axhline(slo, color="tab:red", linestyle="--", label=f"SLO {slo:.0f} ms")
    axis.set_ylim(0, top)
    axis.set_title("quiet tenant: admitted TTFT p99")
    axis.set_ylabel("ms")
    axis.legend(fontsize="small")


def _tenant_goodput_bars(axis: Any, record: dict[str, Any]) -> None:
    """Each tenant's goodput per contestant: the median, the min-max spread and every round."""
    contestants = record["contestants"]
    tenants = list(record["rates"])
    width = 0.8 / len(tenants)
    for t, tenant in enumerate(tenants):
        for x, contestant in enumerate(contestants.values()):
            figures = contestant["tenants"][tenant]
            median, (low, high) = figures["goodput_tok_s"], figures["goodput_tok_s_spread"]
            position = x - 0.4 + width * (t + 0.5)
            axis.bar(
                position, median, width, color=_TENANT_COLORS[t % len(_TENANT_COLORS)],
                yerr=[[median - low], [high - median]], capsize=4, label=tenant if x == 0 else None,
            )  # fmt: skip
            axis.plot([position] * len(figures["goodput_tok_s_runs"]), figures["goodput_tok_s_runs"], "k.")
    axis.set_title("goodput per tenant (TTFT within the SLO)")
    axis.set_ylabel("output tokens / s")
    axis.legend(fontsize="small")


def _tenant_jain_bars(axis: Any, record: dict[str, Any]) -> None:
    """Jain's index per contestant (median, every round) against the target."""
    minimum = record["target"][record["target"]["judged"]]["jain_index"]["min"]
    for x, (name, contestant) in enumerate(record["contestants"].items()):
        axis.bar(x, contestant["jain_index"], color=_FAIR_COLORS[name])
        axis.plot([x] * len(contestant["jain_index_runs"]), contestant["jain_index_runs"], "k.")
    axis.axhline(minimum, color="tab:red", linestyle="--", label=f"target >= {minimum}")
    axis.axhline(0.5, color="tab:gray", linestyle=":", label="0.5: one of two tenants starved")
    axis.set_ylim(0, 1.05)
    axis.set_title("Jain's index over x / min(demand, fair share)")
    axis.legend(fontsize="small", loc="lower right")


def write_tenant_plot(record: dict[str, Any], path: Path) -> None:
    """`python -m bench.tenants`: per contestant (fair queuing on, off), the quiet tenant's admitted
    TTFT p99 against the SLO, each tenant's goodput, and Jain's index against its target."""
    figure, (ttft, goodput, jain) = _panels()
    _tenant_ttft_bars(ttft, record)
    _tenant_goodput_bars(goodput, record)
    _tenant_jain_bars(jain, record)
    names = list(record["contestants"])
    for axis in (ttft, goodput, jain):
        axis.set_xticks(range(len(names)), [f"fair queuing {name}" for name in names])
        axis.grid(True, axis="y", alpha=0.3)
    workload, rates = record["workload"], record["rates"]
    shapes = ", ".join(
        f"{t} {r['prompt_tokens']}+{workload['new_tokens']} tokens at {r['factor']:g}x capacity"
        for t, r in rates.items()
    )
    verdict = "PASS" if record["pass"] else "FAIL"
    cpu = record["provenance"]["machine"]["cpu_model"]
    title = f"bench.tenants ({verdict}): {workload['model']}, {shapes}, {cpu}"
    _save(figure, title, path)
