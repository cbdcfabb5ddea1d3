"""`python -m bench.tenants`: the verdict, the record of the whole run, and its table.

Fair queuing on passes when, in its worst round, the quiet tenant's admitted TTFT p99 (misses
infinite) is within the SLO, the quiet tenant was served at least 99% of what it offered, and Jain's
index over the tenants' normalized throughputs is at least 0.95. FIFO (fair queuing off) is judged
by the same rules beside it, for comparison; only the fair contestant must pass. Errors, miscounted
tokens and another model serving a no_fallback request void the record. This module only shapes
what was measured; it must not measure, nor talk to the stack (bench/tenant_run.py does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bench.admission import ADMISSION_WINDOW_S
from bench.provenance import finish_provenance
from bench.summary import (
    counts_text,
    ms_text,
    options_record,
    pass_text,
    report_text,
    void_reasons,
)

if TYPE_CHECKING:
    import argparse

# The targets for fair queuing: the quiet tenant's served share and Jain's index, at least these.
QUIET_SERVED_SHARE_MIN = 0.99
JAIN_INDEX_MIN = 0.95
CONTESTANTS = ("on", "off")
JUDGED = "on"

NOTES = {
    "contestants": "on: gateway.fair_queuing true; off: false (FIFO across tenants within a priority "
    "class); each round of each contestant runs on a freshly started stack",
    "admission": f"a request not refused (RESOURCE_EXHAUSTED) within {1000 * ADMISSION_WINDOW_S:.0f} ms "
    "of its send is admitted; every admitted request counts toward the SLO whatever happened later",
    "admitted_ttft_p99_ms": "admitted requests; one that never got a first token counts as infinite, "
    "and a p99 landing on one is null",
    "served_share": "completed / offered requests",
    "goodput_tok_s": "output tokens/s of completed requests whose TTFT <= the SLO, over the phase's wall "
    "time from its first send to its last answer",
    "served_cost_tok_s": "x: prompt + output tokens of completed requests per second of wall time",
    "demand_tok_s": "prompt + asked tokens of every offered request per second of the same wall time",
    "fairness": "fair_share: max-min fair share of the total served cost (water-filling over the "
    "demands, equal weights); normalized: x / min(demand, fair share); jain_index: (sum y)^2 / (n sum "
    "y^2) of those (null: nothing served; 0 in the medians)",
    "verdict": "each figure's worst round",
}


def judge_contestant(contestant: dict[str, Any], slo_ms: float) -> dict[str, Any]:
    """A contestant's worst rounds against the targets: quiet admitted TTFT p99, quiet share, Jain."""
    p99_runs = contestant["quiet_admitted_ttft_p99_ms_runs"]
    p99 = None if None in p99_runs else max(p99_runs)
    share = min(contestant["quiet_served_share_runs"])
    jain = min(contestant["jain_index_runs"])
    checks = {
        "quiet_ttft_p99": {"value_ms": p99, "limit_ms": slo_ms, "pass": p99 is not None and p99 <= slo_ms},
        "quiet_served_share": {
            "value": share,
            "min": QUIET_SERVED_SHARE_MIN,
            "pass": share >= QUIET_SERVED_SHARE_MIN,
        },
        "jain_index": {"value": jain, "min": JAIN_INDEX_MIN, "pass": jain >= JAIN_INDEX_MIN},
    }
    return {**checks, "value_is": "the worst round's", "pass": all(c["pass"] for c in checks.values())}


def judge(contestants: dict[str, dict[str, Any]], slo_ms: float) -> dict[str, Any]:
    """Both contestants by the same rules; the verdict is fair queuing's."""
    verdicts = {name: judge_contestant(contestants[name], slo_ms) for name in CONTESTANTS}
    return {"ttft_slo_ms": slo_ms, "judged": JUDGED, **verdicts, "pass": verdicts[JUDGED]["pass"]}


def invalid_reasons(contestants: dict[str, dict[str, Any]], smoke: bool) -> tuple[list[str], list[str]]:
    """(what voids the numbers: errors, miscounted tokens, another model serving; the rest)."""
    voiding = []
    for name in CONTESTANTS:
        for tenant, figures in contestants[name]["tenants"].items():
            where = f"fair queuing {name}, tenant {tenant}"
            voiding += void_reasons(where, figures)
            if figures["fallback_served"]:
                voiding.append(f"{where}: no_fallback requests served by {figures['served_by']}")
    return voiding, (["--smoke run"] if smoke else [])


def build_record(
    args: argparse.Namespace,
    *,
    checkout: dict[str, Any],
    provenance: dict[str, Any],
    workload: dict[str, Any],
    capacity: dict[str, Any],
    stack: dict[str, Any],
    rates: dict[str, Any],
    phases: list[dict[str, Any]],
    contestants: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The whole record: what was run, the capacity, the routes and the rates, every phase in the
    order run, each contestant over its rounds, the verdict."""
    voiding, other = invalid_reasons(contestants, args.smoke)
    reasons = voiding + other
    target = judge(contestants, workload["ttft_slo_ms"])
    return {
        "benchmark": "python -m bench.tenants",
        "valid": not reasons,
        "invalid_reasons": reasons,
        "voided": bool(voiding),
        "smoke": args.smoke,
        "checkout": checkout,
        "workload": workload,
        "capacity": capacity,
        "stack": stack,
        "rates": rates,
        "phases": phases,
        "contestants": contestants,
        "target": target,
        "pass": target["pass"],
        "notes": dict(NOTES),
        "provenance": finish_provenance(provenance),
        "config": options_record(args),
    }


def _spread_text(value: float | None, spread: list[float | None], digits: int) -> str:
    """A median and its min-max; "inf" where a figure landed on a miss."""

    def shown(v: float | None) -> str:
        return "inf" if v is None else f"{v:.{digits}f}"

    return f"{shown(value)} ({shown(spread[0])}-{shown(spread[1])})"


def _round_line(name: str, run: dict[str, Any], tenants: list[str]) -> str:
    quiet = run["tenants"]["quiet"]
    p99 = quiet["admitted_ttft"]["ttft_ms"]["p99"]
    jain = run["fairness"]["jain_index"]
    goodput = " ".join(f"{run['tenants'][t]['goodput_tok_s']:>8.1f}" for t in tenants)
    label = f"round {run['round']}"
    return (
        f"  {name:>4} {label:>8} {'inf' if p99 is None else ms_text(p99):>22} "
        f"{quiet['served_share']:>20.3f} {goodput} {'-' if jain is None else f'{jain:.3f}':>20}  "
        f"refused {counts_text({t: run['tenants'][t]['refused'] for t in tenants})}"
    )


def _verdict_line(name: str, verdict: dict[str, Any]) -> str:
    ttft, share, jain = verdict["quiet_ttft_p99"], verdict["quiet_served_share"], verdict["jain_index"]
    p99 = "inf" if ttft["value_ms"] is None else ms_text(ttft["value_ms"])
    label = "verdict" if name == JUDGED else "beside it"
    return (
        f"{label}, fair queuing {name} (worst round): quiet TTFT p99 {p99} <= {ttft['limit_ms']:.0f} ms: "
        f"{pass_text(ttft['pass'])}; quiet served {share['value']:.3f} >= {share['min']}: "
        f"{pass_text(share['pass'])}; Jain {jain['value']:.3f} >= {jain['min']}: {pass_text(jain['pass'])}; "
        f"{pass_text(verdict['pass'])}"
    )


def format_report(record: dict[str, Any]) -> str:
    """The rates, then a block per contestant (median and spread, then each round), then the verdicts."""
    workload, rates = record["workload"], record["rates"]
    tenants = list(rates)
    lines = [
        f"tenants, open loop (Poisson), TTFT SLO {workload['ttft_slo_ms']:.0f} ms; admitted = not refused "
        f"within {1000 * ADMISSION_WINDOW_S:.0f} ms; {workload['new_tokens']} new tokens each"
    ]
    for tenant, rate in rates.items():
        lines.append(
            f"  {tenant}: {rate['prompt_tokens']}-token prompts at {rate['rate_rps']:.2f} req/s = "
            f"{rate['factor']:g} x capacity {rate['capacity_rps']:.2f} req/s, "
            f"{rate['arrivals_per_phase']} arrivals per phase"
        )
    goodput = " ".join(f"{t:>8}" for t in tenants)
    lines.append(
        f"  {'fair':>4} {'':>8} {'quiet TTFT p99 ms':>22} {'quiet served share':>20} {goodput} "
        f"{'Jain index':>20}   (goodput tok/s per tenant)"
    )
    for name in CONTESTANTS:
        contestant = record["contestants"][name]
        goodputs = " ".join(f"{contestant['tenants'][t]['goodput_tok_s']:>8.1f}" for t in tenants)
        p99 = _spread_text(
            contestant["quiet_admitted_ttft_p99_ms"], contestant["quiet_admitted_ttft_p99_ms_spread"], 0
        )
        share = _spread_text(contestant["quiet_served_share"], contestant["quiet_served_share_spread"], 3)
        jain = _spread_text(contestant["jain_index"], contestant["jain_index_spread"], 3)
        lines.append(f"  {name:>4} {'median':>8} {p99:>22} {share:>20} {goodputs} {jain:>20}")
        lines.extend(_round_line(name, run, tenants) for run in contestant["runs"])
    target = record["target"]
    lines.extend(_verdict_line(name, target[name]) for name in CONTESTANTS)
    return report_text(lines, record)
