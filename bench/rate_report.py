"""`strata bench --rate`: each rate's verdict, the record of the whole invocation, and its table.

The record holds what every rate shares at the top (provenance, checkout, stack, config, the workload
without the rate, the capacity run) and one entry per offered rate under `rates`: its schedule, its
two phases reduced over the rounds (bench/rate_phase.py) and its verdict. A rate passes when, in each
phase and for each route that admitted requests, the admitted requests' TTFT p99 (misses infinite)
is within 1.1 x the SLO; goodput with fallback on is at least 1.5 x goodput with it off; and, where
the gateway's histogram was scraped and it refused any, its refusal decision p99 (a bucket's upper
bound) is under 10 ms. Errors, miscounted tokens and fallback answers with fallback off void the
record. This module only shapes what was measured; it must not measure, nor talk to the stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bench.admission import ADMISSION_WINDOW_S
from bench.provenance import finish_provenance
from bench.rate_phase import PHASES
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
    from collections.abc import Sequence

# The targets: fallback on gives at least this times the goodput of fallback off; the admitted
# requests' TTFT p99 stays within this times the SLO; the gateway decides a refusal within this.
GOODPUT_RATIO_MIN = 1.5
TTFT_P99_SLO_FACTOR = 1.1
GATEWAY_REFUSAL_P99_MAX_MS = 10.0

NOTES = {
    "admission": f"a request not refused (RESOURCE_EXHAUSTED) within {1000 * ADMISSION_WINDOW_S:.0f} ms "
    "of its send is admitted; every admitted request counts toward the SLO whatever happened later",
    "routes": "primary: served by the primary, or failed without naming a model; fallback: served by "
    "any other model (GenerateResponse.model)",
    "ttft_ms": "admitted requests; one that never got a first token counts as infinite, and a "
    "percentile landing on one is null (no_first_token says how many)",
    "goodput": "output tokens/s of completed requests whose TTFT <= the SLO, over the phase's "
    "wall time from its first send to its last answer",
    "itl_ms": "inter-token gaps of admitted completed requests",
    "refusal_decision_ms": "client-side, send -> RESOURCE_EXHAUSTED of refusals at admission: "
    "includes the network hop and the client's own event loop",
    "gateway_decision": "the gateway's strata_gateway_admission_decision_seconds, every route added "
    "up, bucket deltas between scrapes before and after each phase (the rounds added up); p99_ms is "
    "the upper bound of the bucket holding the 99th percentile, not an interpolation (null with "
    "p99_over_ms: past the last finite bucket); null: no metrics address was known",
}


def _ttft_checks(phases: dict[str, dict[str, Any]], limit_ms: float) -> dict[str, dict[str, Any]]:
    """Per phase and route that admitted requests: the worst round's admitted TTFT p99 against the
    limit (a median over rounds would let one bad round pass; None, a miss, fails)."""
    checks: dict[str, dict[str, Any]] = {}
    for name in PHASES:
        for route, figures in phases[name]["routes"].items():
            if not figures["admitted"]:
                continue
            rounds = [
                p99
                for p99, admitted in zip(figures["ttft_p99_ms_runs"], figures["admitted_runs"], strict=True)
                if admitted
            ]
            value = None if None in rounds else max(rounds)
            checks.setdefault(name, {})[route] = {
                "admitted": figures["admitted"],
                "no_first_token": figures["no_first_token"],
                "limit_ms": limit_ms,
                "value_ms": value,
                "value_is": "the worst round's p99",
                "pass": value is not None and value <= limit_ms,
            }
    return checks


def _gateway_checks(phases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per phase: the gateway's refusal decision p99 against the limit, when it was scraped and refused."""
    checks = {}
    for name in PHASES:
        decision = phases[name]["gateway_decision"]
        refused = decision["refused"] if decision is not None else None
        known = refused is not None and refused["count"] > 0
        p99 = refused["p99_ms"] if refused is not None else None
        checks[name] = {
            "known": known,
            "count": refused["count"] if refused is not None else None,
            "p99_ms": p99,
            "p99_over_ms": refused["p99_over_ms"] if refused is not None else None,
            "limit_ms": GATEWAY_REFUSAL_P99_MAX_MS,
            # p99 is its bucket's upper bound: at most the limit means the p99 itself is within it.
            "pass": (p99 is not None and p99 <= GATEWAY_REFUSAL_P99_MAX_MS) if known else None,
        }
    return checks


def judge_rate(phases: dict[str, dict[str, Any]], slo_ms: float) -> dict[str, Any]:
    """One rate's verdict: admitted TTFT p99 per phase and route, goodput on/off, gateway refusal p99."""
    off, on = phases["off"], phases["on"]
    verdict: dict[str, Any] = {"ttft_slo_ms": slo_ms, "ttft_p99_slo_factor": TTFT_P99_SLO_FACTOR}
    verdict["ttft_p99"] = _ttft_checks(phases, TTFT_P99_SLO_FACTOR * slo_ms)
    verdict["ttft_pass"] = all(c["pass"] for routes in verdict["ttft_p99"].values() for c in routes.values())
    verdict["goodput_ratio_min"] = GOODPUT_RATIO_MIN
    if off["goodput_tok_s"] > 0:
        verdict["goodput_ratio"] = on["goodput_tok_s"] / off["goodput_tok_s"]
        verdict["goodput_pass"] = verdict["goodput_ratio"] >= GOODPUT_RATIO_MIN
    else:  # nothing met the SLO without the fallback: any goodput with it is an unbounded gain
        verdict["goodput_ratio"] = None
        verdict["goodput_pass"] = on["goodput_tok_s"] > 0
    verdict["goodput_ratio_runs"] = [
        (b / a if a > 0 else None)
        for a, b in zip(off["goodput_tok_s_runs"], on["goodput_tok_s_runs"], strict=True)
    ]
    verdict["gateway_refusal_p99"] = _gateway_checks(phases)
    verdict["gateway_refusal_pass"] = all(
        c["pass"] for c in verdict["gateway_refusal_p99"].values() if c["known"]
    )
    verdict["pass"] = bool(
        verdict["ttft_pass"] and verdict["goodput_pass"] and verdict["gateway_refusal_pass"]
    )
    return verdict


def rate_entry(
    *, rate_rps: float, rate_source: str, offsets: Sequence[float], phases: dict[str, Any], slo_ms: float
) -> dict[str, Any]:
    """One offered rate of the record: its schedule, its phases and its verdict."""
    return {
        "rate_rps": rate_rps,
        "rate_source": rate_source,
        "arrivals_per_phase": len(offsets),
        "schedule_s": offsets[-1],
        "phases": phases,
        "target": judge_rate(phases, slo_ms),
    }


def invalid_reasons(rates: Sequence[dict[str, Any]], smoke: bool) -> tuple[list[str], list[str]]:
    """(what voids the numbers: errors, miscounted tokens, fallback use with fallback off; the rest)."""
    voiding = []
    for entry in rates:
        where = f"rate {entry['rate_rps']:g}/s"
        for name, phase in entry["phases"].items():
            voiding += void_reasons(f"{where}, fallback {name}", phase)
        if entry["phases"]["off"]["fallback_served"]:
            voiding.append(
                f"{where}, fallback off: other models served {entry['phases']['off']['served_by']}"
            )
    return voiding, (["--smoke run"] if smoke else [])


def build_rate_record(
    args: argparse.Namespace,
    *,
    checkout: dict[str, Any],
    stack: dict[str, Any],
    provenance: dict[str, Any],
    workload: dict[str, Any],
    capacity: dict[str, Any] | None,
    rates: list[dict[str, Any]],
) -> dict[str, Any]:
    """The whole record; `workload` holds the SLO and schedule options, each rate entry its own rate."""
    voiding, other = invalid_reasons(rates, args.smoke)
    reasons = voiding + other
    return {
        "benchmark": "strata bench --rate",
        "valid": not reasons,
        "invalid_reasons": reasons,
        "voided": bool(voiding),
        "smoke": args.smoke,
        "checkout": checkout,
        "workload": workload,
        "capacity": capacity,
        "stack": stack,
        "rates": rates,
        "pass": all(entry["target"]["pass"] for entry in rates),
        "notes": dict(NOTES),
        "provenance": finish_provenance(provenance),
        "config": options_record(args),
    }


def _ttft_cell(route: dict[str, Any]) -> str:
    """An admitted TTFT p99: "-" when the route admitted none, "inf" when it lands on a miss."""
    if not route["admitted"]:
        return "-"
    return "inf" if route["ttft_ms"]["p99"] is None else ms_text(route["ttft_ms"]["p99"])


def _bound_text(refused: dict[str, Any]) -> str:
    """A refusal decision p99 as its bucket's bound: "<=5", or ">1000" past the last finite bucket."""
    return f"<={refused['p99_ms']:g}" if refused["p99_ms"] is not None else f">{refused['p99_over_ms']:g}"


def _gateway_cell(decision: dict[str, Any] | None) -> str:
    """The gateway's refusal p99; "-" when it was not scraped or refused nothing."""
    if decision is None or not decision["refused"]["count"]:
        return "-"
    return _bound_text(decision["refused"])


def _verdict_line(target: dict[str, Any]) -> str:
    ttft = ", ".join(
        f"{name}/{route} {'inf' if c['value_ms'] is None else ms_text(c['value_ms'])}"
        for name, routes in target["ttft_p99"].items()
        for route, c in routes.items()
    )
    limit = TTFT_P99_SLO_FACTOR * target["ttft_slo_ms"]
    ratio = target["goodput_ratio"]
    shown = "unbounded (off had none)" if ratio is None else f"{ratio:.2f}"
    known = {n: c for n, c in target["gateway_refusal_p99"].items() if c["known"]}
    gateway = ", ".join(f"{n} {_bound_text(c)}" for n, c in known.items()) or "not measured"
    return (
        f"  admitted TTFT p99 ({ttft}) ms <= {limit:.0f}: {pass_text(target['ttft_pass'])}; "
        f"goodput on/off {shown} >= {target['goodput_ratio_min']}: {pass_text(target['goodput_pass'])}; "
        f"gateway refusal p99 ({gateway}) ms < {GATEWAY_REFUSAL_P99_MAX_MS:g}: "
        f"{pass_text(target['gateway_refusal_pass'])}; rate {pass_text(target['pass'])}"
    )


def format_rate_report(record: dict[str, Any]) -> str:
    """One block per rate: a line per phase, then the rate's verdict."""
    workload = record["workload"]
    slo = workload["ttft_slo_ms"]
    lines = [
        f"open loop ({workload['arrival']}): TTFT SLO {slo:.0f} ms, admitted p99 limit "
        f"{TTFT_P99_SLO_FACTOR * slo:.0f} ms; admitted = not refused within "
        f"{1000 * ADMISSION_WINDOW_S:.0f} ms; TTFT pri/fb: primary and fallback routes"
    ]
    header = (
        f"  {'fallback':>8} {'goodput':>8} {'(min-max)':>13} {'offered':>7} {'admitted':>8} {'refused':>7} "
        f"{'TTFT p99 pri/fb':>15} {'ITL p99':>7} {'refusal p99 cli/gw':>18} {'reasons':>20} {'errors':>7}"
    )
    for entry in record["rates"]:
        lines.append(
            f"rate {entry['rate_rps']:.2f} req/s ({entry['rate_source']}): {entry['arrivals_per_phase']} "
            f"arrivals per phase over {entry['schedule_s']:.1f} s; ms unless said"
        )
        lines.append(header)
        for name in PHASES:
            phase = entry["phases"][name]
            low, high = phase["goodput_tok_s_spread"]
            ttft = f"{_ttft_cell(phase['routes']['primary'])}/{_ttft_cell(phase['routes']['fallback'])}"
            decision = (
                f"{ms_text(phase['refusal_decision_ms']['p99'])}/{_gateway_cell(phase['gateway_decision'])}"
            )
            lines.append(
                f"  {name:>8} {phase['goodput_tok_s']:>8.1f} {f'{low:.1f}-{high:.1f}':>13} "
                f"{phase['offered']:>7} {phase['admitted']:>8} {phase['refused']:>7} {ttft:>15} "
                f"{ms_text(phase['itl_ms']['p99']):>7} {decision:>18} "
                f"{counts_text(phase['refusal_reasons']):>20} {counts_text(phase['errors']):>7}"
            )
        lines.append(_verdict_line(entry["target"]))
    lines.append(f"all rates: {pass_text(record['pass'])}")
    return report_text(lines, record)
