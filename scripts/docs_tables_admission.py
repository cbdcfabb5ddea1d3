"""The generated tables of admission's own benchmarks beyond the fallback and tenants runs: admission on
prompts the prefix cache holds (bench/cached_admission.py), the inter-token SLO kept beside the
first token's (bench/itl_admission.py) and one tenant's flood of connections and streams beside
another tenant (bench/flood.py). This module only renders records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from docs_tables_common import Table, met, ratio, runs, spread, table

if TYPE_CHECKING:
    from collections.abc import Mapping

    from docs_tables_common import Record

CACHED = "cached-admission-cpu.json"
ITL = "itl-admission-cpu.json"
FLOOD = "flood-cpu.json"
_MODE_NAMES = {
    "guess": "guess what is cached (the product)",
    "oracle": "told the true cached length (oracle)",
    "price_all": "price every prompt token",
}


def _p99(value: float | None) -> str:
    return "no first token" if value is None else f"{value / 1000:.2f} s"


def cached_admission(records: Mapping[str, Record]) -> list[str]:
    """Each mode's admitted TTFT p99 (median of the rounds), goodput and refusals, then the target."""
    data: dict[str, Any] = records[CACHED].data
    slo_s = data["ttft_slo_ms"] / 1000
    rows = []
    for mode, name in _MODE_NAMES.items():
        phase = data["phases"][mode]
        primary = phase["routes"]["primary"]
        rows.append(
            [
                name,
                _p99(primary["ttft_ms"]["p99"]),
                spread(phase["goodput_tok_s"], phase["goodput_tok_s_spread"]),
                f"{phase['admitted']} / {phase['refused']}",
                f"{primary['met_slo']} / {primary['admitted']}",
            ]
        )
    header = [
        f"forecast (offered {data['offered_rps']:.2f} req/s)",
        f"admitted TTFT p99 (SLO {slo_s:g} s)",
        "goodput tok/s, median (min-max)",
        "admitted / refused",
        "admitted within the SLO",
    ]
    target = data["target"]
    limit = target["admitted_ttft_p99_over_slo_at_most"]
    over = target["guess_ttft_p99_over_slo"]
    phases = data["phases"]
    verdicts = [
        [f"guessing: admitted TTFT p99 <= {limit}x the SLO", "no first token" if over is None else
         ratio(over), met(target["ttft_met"])],
        [f"guessing: goodput >= {target['goodput_over_oracle_at_least']}x the oracle's",
         _ratio(target["goodput_guess_over_oracle"]), met(target["goodput_met"])],
        ["goodput, guessing over pricing every token", _ratio(target["goodput_guess_over_price_all"]), ""],
    ]  # fmt: skip
    rounds = [[_MODE_NAMES[mode], runs(phases[mode]["goodput_tok_s_runs"], 1)] for mode in _MODE_NAMES]
    return [
        *table(header, rows),
        "",
        *table(["target (medians of the rounds)", "measured", ""], verdicts),
        "",
        *table(["forecast", "goodput tok/s of each round"], rounds),
    ]


def _ratio(value: float | None) -> str:
    return "none" if value is None else ratio(value)


_PHASE_NAMES = {"ttft": "first token only (itl_slo_ms 0)", "itl": "and the tokens after it"}


def itl_admission(records: Mapping[str, Record]) -> list[str]:
    """Each phase's inter-token and admitted TTFT p99 (medians of the rounds), goodputs and refusals,
    then the targets."""
    data: dict[str, Any] = records[ITL].data
    itl_slo = data["workload"]["itl_slo_ms"]
    rows = []
    for phase_name, name in _PHASE_NAMES.items():
        phase = data["phases"][phase_name]
        primary = phase["routes"]["primary"]
        rows.append(
            [
                name,
                f"{phase['itl_ms']['p99']:.0f} ms",
                _p99(primary["ttft_ms"]["p99"]),
                spread(phase["goodput_tok_s"], phase["goodput_tok_s_spread"]),
                spread(phase["goodput_both_tok_s"], phase["goodput_both_tok_s_spread"]),
                f"{phase['admitted']} / {phase['refused']}",
            ]
        )
    header = [
        f"the route promises ({data['workload']['rate']:g} req/s offered)",
        f"inter-token p99 (SLO {itl_slo:g} ms)",
        f"admitted TTFT p99 (SLO {data['ttft_slo_ms'] / 1000:g} s)",
        "goodput tok/s, TTFT met",
        "goodput tok/s, both met",
        "admitted / refused",
    ]
    target = data["target"]
    goodput = ratio(target["goodput_over_ttft_only"])
    low, high = target["goodput_over_ttft_only_spread"]
    verdicts = [
        [f"inter-token p99 <= {target['itl_p99_over_slo_at_most']}x the ITL SLO",
         ratio(target["itl_p99_over_slo"]), met(target["itl_met"])],
        [f"admitted TTFT p99 <= {target['ttft_p99_over_slo_at_most']}x the TTFT SLO",
         ratio(target["ttft_p99_over_slo"]), met(target["ttft_met"])],
        [f"goodput, both met, >= {target['goodput_over_ttft_only_at_least']}x the TTFT-only run's",
         f"{goodput} ({ratio(low)}-{ratio(high)})", met(target["goodput_met"])],
        [f"without the ITL SLO: inter-token p99 over {itl_slo:g} ms",
         ratio(target["ttft_phase_itl_p99_over_slo"]), ""],
    ]  # fmt: skip
    return [
        *table(header, rows),
        "",
        *table(["target (medians of the rounds)", "measured", ""], verdicts),
    ]


def _ms(value: float | None) -> str:
    return "none" if value is None else f"{value:,.0f} ms"


def flood(records: Mapping[str, Record]) -> list[str]:
    """Per contestant over its rounds (bench/flood.py's summaries): the quiet tenant's TTFT p99 and
    refusals, the flood's calls by outcome and its refusals' time in the gateway, the gateway's memory;
    then the targets."""
    data: dict[str, Any] = records[FLOOD].data
    rows = []
    for contestant, summary in data["contestants"].items():
        outcomes = "; ".join(
            f"{status} {count:,.0f}" for status, count in summary["flood_outcomes_median"].items()
        )
        rss = summary["gateway_rss_mib_median"]
        statuses = [
            s for r in data["rounds"] if r["contestant"] == contestant for s in r["quiet"]["statuses"]
        ]
        refused = sum(status == "RESOURCE_EXHAUSTED" for status in statuses)
        rows.append(
            [
                contestant,
                _ms(summary["quiet_ttft_p99_ms"]),
                f"{refused} / {summary['quiet_refused'] - refused} of {summary['quiet_sent']}",
                f"{summary['flood_calls_median']:,.0f}: {outcomes}",
                f"{summary['flood_refusal_gateway_p99_ms']:.1f} ms",
                _ms(summary["flood_refusal_client_p99_ms"]),
                f"{rss['before']:.0f} / {rss['peak']:.0f} / {rss['after']:.0f}",
            ]
        )
    workload = data["workload"]
    header = [
        "gateway",
        f"quiet TTFT p99 (SLO {data['ttft_slo_ms'] / 1000:g} s)",
        "quiet refused / cancelled",
        "flood calls sent, by outcome (median round)",
        "flood refusals p99, in the gateway",
        "at the flood's client (median round)",
        "gateway RSS MiB before / peak / after",
    ]
    verdicts = [[line["target"], line["figure"], met(line["met"])] for line in data["targets"]]
    return [
        f"{workload['connections']:,} connections and {workload['streams']:,} streams of "
        f"{workload['flood_tokens']} tokens, kept open; {workload['quiet_requests']} quiet requests a "
        f"round; {workload['runs']} rounds of each gateway, alternated.",
        "",
        *table(header, rows),
        "",
        *table(["target (fair, every round's requests together)", "measured", ""], verdicts),
    ]


TABLES = (
    Table("cached-admission", (CACHED,), cached_admission),
    Table("itl-admission", (ITL,), itl_admission),
    Table("flood", (FLOOD,), flood),
)
