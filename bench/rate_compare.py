"""Two `strata bench --rate` records compared rate by rate: what a change did to the admission promise.

    python -m bench.rate_compare BEFORE.json AFTER.json [--json OUT.json]

For every rate present in both records (rates match by value; two `--rate auto` rates match each
other whatever capacity each run measured): goodput with fallback off, after / before (target >=
0.9: the change must not buy its promise with the primary's own throughput); the admitted requests'
inter-token latency p99 per phase, after / before (target <= 1.2); and the after record's goodput on
/ off (against the bound its own verdict holds, 1.5). Every figure is read from the two records,
none typed in; the comparison names both records' commits and validity and prints a table. This
module only reads records; it must not run a benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.provenance import start_provenance
from bench.stats import save_record

OFF_GOODPUT_RATIO_MIN = 0.9
ITL_P99_RATIO_MAX = 1.2
PHASES = ("off", "on")


def read_record(path: Path) -> dict[str, Any]:
    """A `strata bench --rate` record with its per-rate entries; SystemExit when it is not one."""
    record: dict[str, Any] = json.loads(path.read_text())
    if record.get("benchmark") != "strata bench --rate" or not isinstance(record.get("rates"), list):
        raise SystemExit(f"rate_compare: {path} is no `strata bench --rate` record with per-rate entries")
    return record


def rate_key(entry: dict[str, Any]) -> str:
    """How a rate is matched across records: "auto", or its value in requests/s."""
    return "auto" if str(entry["rate_source"]).startswith("auto") else f"{entry['rate_rps']:g}"


def ratio(after: float | None, before: float | None) -> float | None:
    """after / before; None when either is missing or before is 0."""
    if after is None or before is None or before == 0:
        return None
    return after / before


def compare_rate(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One rate's three comparisons, each with both figures, the ratio, the bound and pass."""
    old, new = before["phases"]["off"]["goodput_tok_s"], after["phases"]["off"]["goodput_tok_s"]
    off_ratio = ratio(new, old)
    off_goodput = {
        "before_tok_s": old,
        "after_tok_s": new,
        "ratio": off_ratio,
        "min": OFF_GOODPUT_RATIO_MIN,
        "pass": off_ratio is not None and off_ratio >= OFF_GOODPUT_RATIO_MIN,
    }
    itl = {}
    for name in PHASES:
        old_ms, new_ms = before["phases"][name]["itl_ms"]["p99"], after["phases"][name]["itl_ms"]["p99"]
        itl_ratio = ratio(new_ms, old_ms)
        itl[name] = {
            "before_ms": old_ms,
            "after_ms": new_ms,
            "ratio": itl_ratio,
            "max": ITL_P99_RATIO_MAX,
            "pass": itl_ratio is not None and itl_ratio <= ITL_P99_RATIO_MAX,
        }
    target = after["target"]
    on_off, bound = target["goodput_ratio"], target["goodput_ratio_min"]
    goodput_on_off = {
        "value": on_off,
        "min": bound,
        # None: nothing met the SLO with fallback off; the after record's own verdict judged that case.
        "pass": on_off >= bound if on_off is not None else bool(target["goodput_pass"]),
    }
    checks = [off_goodput["pass"], *(c["pass"] for c in itl.values()), goodput_on_off["pass"]]
    return {
        "rate": rate_key(after),
        "rate_rps": {"before": before["rate_rps"], "after": after["rate_rps"]},
        "off_goodput": off_goodput,
        "itl_p99": itl,
        "after_goodput_on_off": goodput_on_off,
        "pass": all(checks),
    }


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Every rate in both records compared; the rates only one of them has are listed."""
    old = {rate_key(entry): entry for entry in before["rates"]}
    new = {rate_key(entry): entry for entry in after["rates"]}
    rates = [compare_rate(old[key], new[key]) for key in new if key in old]
    return {
        "rates": rates,
        "only_before": [key for key in old if key not in new],
        "only_after": [key for key in new if key not in old],
        "pass": bool(rates) and all(rate["pass"] for rate in rates),
    }


def _figure(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _verdict(check: dict[str, Any]) -> str:
    return f"{_figure(check['ratio'], 2)} {'PASS' if check['pass'] else 'FAIL'}"


def _pair(before: float | None, after: float | None, digits: int) -> str:
    return f"{_figure(before, digits)}/{_figure(after, digits)}"


def format_comparison(result: dict[str, Any]) -> str:
    """One line per rate: off goodput before/after and ratio, ITL p99 per phase, after's on/off."""
    lines = []
    for side in ("before", "after"):
        figures = result[side]
        commit = (figures["commit"] or "no commit") + ("+dirty" if figures["dirty"] else "")
        lines.append(f"{side:<6} {figures['path']} ({commit})")
    itl_header = " ".join(
        f"{f'ITL p99 {name} b/a ms':>18} {f'ratio <= {ITL_P99_RATIO_MAX}':>14}" for name in PHASES
    )
    lines.append(
        f"{'rate':>8} {'off goodput b/a tok/s':>22} {f'ratio >= {OFF_GOODPUT_RATIO_MIN}':>14} {itl_header} "
        f"{'after on/off':>20}"
    )
    for rate in result["rates"]:
        off, on_off = rate["off_goodput"], rate["after_goodput_on_off"]
        itl = " ".join(
            f"{_pair(c['before_ms'], c['after_ms'], 0):>18} {_verdict(c):>14}"
            for c in rate["itl_p99"].values()
        )
        shown = "unbounded" if on_off["value"] is None else f"{on_off['value']:.2f}"
        on_off_cell = f"{shown} >= {on_off['min']:g} {'PASS' if on_off['pass'] else 'FAIL'}"
        lines.append(
            f"{rate['rate']:>8} {_pair(off['before_tok_s'], off['after_tok_s'], 1):>22} "
            f"{_verdict(off):>14} {itl} {on_off_cell:>20}"
        )
    for side in ("before", "after"):
        if result[f"only_{side}"]:
            lines.append(f"only in {side}: {', '.join(result[f'only_{side}'])}")
        if not result[side]["valid"]:
            lines.append(f"the {side} record is not valid: {'; '.join(result[side]['invalid_reasons'])}")
    lines.append(f"all compared rates: {'PASS' if result['pass'] else 'FAIL'}")
    return "\n".join(lines)


def _side(path: Path, record: dict[str, Any]) -> dict[str, Any]:
    checkout = record.get("checkout") or {}
    return {
        "path": str(path),
        "commit": checkout.get("commit"),
        "dirty": checkout.get("dirty"),
        "valid": record["valid"],
        "invalid_reasons": record["invalid_reasons"],
        "date": record["provenance"]["date"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rate_compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("before", type=Path, help="the record before the change")
    parser.add_argument("after", type=Path, help="the record after the change")
    parser.add_argument("--json", type=Path, help="where to write the comparison")
    args = parser.parse_args(argv)
    before, after = read_record(args.before), read_record(args.after)
    result = {
        "benchmark": "bench.rate_compare",
        "provenance": start_provenance(),
        "before": _side(args.before, before),
        "after": _side(args.after, after),
        "targets": {
            "off_goodput_ratio_min": OFF_GOODPUT_RATIO_MIN,
            "itl_p99_ratio_max": ITL_P99_RATIO_MAX,
            "after_goodput_on_off": "the after record's own goodput_ratio_min, per rate",
        },
        **compare(before, after),
    }
    print(format_comparison(result))
    save_record(result, args.json)
    if args.json is not None:
        print(f"wrote {args.json}")
    if not result["rates"]:
        print("rate_compare: no rate is in both records", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
