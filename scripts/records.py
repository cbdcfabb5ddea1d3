"""Rerun, at HEAD, every record README.md and docs/ quote, then regenerate the docs' tables from them.

`make records` runs this. The records are those a generated table reads (scripts/docs_tables.py) plus
those a page names in prose; each reruns by the command its provenance stores (the catalog's,
scripts/docs_tables_catalog.py, where it stores none), one at a time, with a progress line each. At
the end it says, record by record, what changed against the record it replaced: every figure of the
tables that record feeds, cell by cell, or for a record quoted only in prose its ratios, key by key.
Then it rewrites the tables. It refuses to start on a tree whose tracked files differ from HEAD (a
record names the commit it measured) or on a busy machine (the figures would measure the neighbours).

`--list` prints what it would run and each record's estimated run time; `--only NAME` runs one;
`--stale` lists the records more than 50 commits behind HEAD in the paths they measure. Records that
compare against code no longer at HEAD are history and never rerun; the reliability report and the
chaos soak have targets of their own (`make reliability`, `make chaos`). This module runs the
benchmarks' own commands and must not time or judge anything itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import docs_tables
from docs_tables_catalog import CATALOG
from docs_tables_common import RESULTS, ROOT, Record
from docs_tables_runs import STALE_AFTER, behind, current, minutes, quoted_records, rerunnable

DEFAULT_MAX_LOAD = 0.5 * (
    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)
SETTLE_S = 180.0
RATIO_KEYS = ("ratio", "_vs_", "_over_")


def read(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else None


def command(name: str) -> list[str]:
    """The record's stored command, made runnable here (python and strata from this venv)."""
    data = read(name) or {}
    stored = data.get("provenance", {}).get("command") if isinstance(data.get("provenance"), dict) else None
    argv = list(stored) if stored else list(CATALOG[name].command) if name in CATALOG else []
    if not argv:
        raise SystemExit(
            f"{name}: its provenance stores no command and the catalog has none: "
            "add one to scripts/docs_tables_catalog.py"
        )
    head = Path(argv[0]).name
    if head.startswith("python"):
        argv[0] = sys.executable
    elif head == "strata":
        argv[0] = str(Path(sys.executable).with_name("strata"))
    elif argv[0].endswith(".py"):
        argv.insert(0, sys.executable)
    return argv


def estimate(name: str) -> int:
    return CATALOG[name].estimate_s if name in CATALOG else 0


def refuse_reason(max_load: float) -> str:
    changed = subprocess.run(
        ["git", "diff", "--name-only", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    files = changed.stdout.split()
    if files:
        return (
            f"the tree's tracked files differ from HEAD ({len(files)} files, e.g. {files[0]}): "
            "a record must name the commit it measured; commit or stash them, then run `make records` again"
        )
    load = os.getloadavg()[0]
    if load > max_load:
        return (
            f"the load average is {load:.2f} over the last minute, above {max_load:.2f}: "
            "other work shares the CPUs and would move the figures; "
            "wait until `uptime` shows less (or pass --max-load)"
        )
    return ""


def settle(max_load: float) -> None:
    """Wait, at most SETTLE_S, for the last run's load to decay before the next one starts."""
    deadline = time.monotonic() + SETTLE_S
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(5)


def _rows(lines: list[str]) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| ")]


def table_changes(name: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Every figure of every table `name` feeds that differs between its old and new record."""
    out = []
    for spec in docs_tables.RECORD_TABLES:
        if name not in spec.records:
            continue
        others: dict[str, Record] = {}
        for other in spec.records:
            data = read(other)
            if other != name and data is not None:
                others[other] = Record(other, data)
        try:
            before = spec.render({**others, name: Record(name, old)})
        except (KeyError, TypeError, IndexError) as exc:
            out.append(f"  table {spec.name}: the previous record lacks {exc}, so it is not compared")
            continue
        after = spec.render({**others, name: Record(name, new)})
        old_rows, new_rows = _rows(before), _rows(after)
        header = new_rows[0] if new_rows else []
        for old_row, new_row in zip(old_rows[2:], new_rows[2:], strict=False):
            for column, (was, now) in enumerate(zip(old_row, new_row, strict=False)):
                if was != now:
                    label = header[column] if column < len(header) else str(column)
                    out.append(f"  table {spec.name}, {new_row[0] or 'row'}, {label}: {was} -> {now}")
        if len(old_rows) != len(new_rows):
            out.append(f"  table {spec.name}: {len(old_rows) - 2} rows before, {len(new_rows) - 2} now")
        prose = [
            (was, now)
            for was, now in zip(before, after, strict=False)
            if not was.startswith("|") and was != now
        ]
        out += [f"  table {spec.name}: {was} -> {now}" for was, now in prose]
    return out


def _ratios(data: object, prefix: str = "") -> dict[str, float]:
    if isinstance(data, Mapping):
        found: dict[str, float] = {}
        for key, value in data.items():
            found.update(_ratios(value, f"{prefix}{key}."))
        return found
    key = prefix.rstrip(".")
    if isinstance(data, float) and any(mark in key.rsplit(".", 1)[-1] for mark in RATIO_KEYS):
        return {key: data}
    return {}


def changes(name: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[str]:
    if new is None:
        return ["  no record written"]
    if old is None:
        return ["  new record (none before)"]
    fed = [line for line in table_changes(name, old, new)]
    if any(name in spec.records for spec in docs_tables.RECORD_TABLES):
        return fed or ["  every figure its tables show is unchanged"]
    before, after = _ratios(old), _ratios(new)
    diff = [
        f"  {key}: {before[key]:.3g} -> {after[key]:.3g}"
        for key in sorted(before.keys() & after.keys())
        if f"{before[key]:.3g}" != f"{after[key]:.3g}"
    ]
    return diff or ["  every ratio is unchanged"]


def stale_lines(names: list[str]) -> list[str]:
    out = []
    for name in names:
        data = read(name)
        prov = data.get("provenance") if data else None
        if not isinstance(prov, dict) or "commit" not in prov:
            out.append(f"{name}: no provenance, awaits a rerun")
            continue
        paths = CATALOG[name].depends_on if name in CATALOG else ("services/", "gateway/", "strata/")
        count = behind(str(prov["commit"]), paths)
        if count is None:
            out.append(f"{name}: its commit {str(prov['commit'])[:7]} is not in this repository")
        elif count > STALE_AFTER:
            out.append(f"{name}: {count} commits behind HEAD in {', '.join(paths)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print what would run, with estimated run times")
    parser.add_argument(
        "--only", metavar="NAME", help="rerun one record (its file name under bench/results/)"
    )
    parser.add_argument(
        "--stale", action="store_true", help=f"list records more than {STALE_AFTER} commits behind HEAD"
    )
    parser.add_argument(
        "--max-load", type=float, default=DEFAULT_MAX_LOAD, help="refuse above this 1-minute load average"
    )
    args = parser.parse_args(argv)
    quoted = quoted_records(docs_tables.RECORD_TABLES)
    names = rerunnable(quoted)
    if args.only:
        if args.only not in names:
            raise SystemExit(
                f"--only {args.only}: not a record the docs quote and that can be rerun; `--list` shows them"
            )
        names = [args.only]
    if args.stale:
        lines = stale_lines(current(quoted))
        print("\n".join(lines) if lines else f"no record is more than {STALE_AFTER} commits behind HEAD")
        return 0
    if args.list:
        for name in names:
            print(f"{name}  ~{minutes(estimate(name))}  {' '.join(command(name))}")
        for name in sorted(set(quoted) - set(rerunnable(quoted))):
            entry = CATALOG[name]
            why = "history (it measured code no longer at HEAD)" if entry.history else f"by `{entry.target}`"
            print(f"{name}  not rerun here: {why}")
        print(f"total: about {sum(map(estimate, names)) / 60:.0f} minutes (an estimate)")
        return 0
    reason = refuse_reason(args.max_load)
    if reason:
        print(f"make records: not started: {reason}", file=sys.stderr)
        return 2
    summary: dict[str, list[str]] = {}
    failed: list[str] = []
    started = time.monotonic()
    for index, name in enumerate(names, 1):
        if index > 1:
            settle(args.max_load)
        argv_run = command(name)
        print(
            f"[{index}/{len(names)}] {name}: {' '.join(argv_run)} (about {minutes(estimate(name))})",
            flush=True,
        )
        old = read(name)
        begin = time.monotonic()
        code = subprocess.run(argv_run, cwd=ROOT, check=False).returncode
        took = time.monotonic() - begin
        print(
            f"[{index}/{len(names)}] {name}: {'done' if code == 0 else f'FAILED (exit {code})'} "
            f"in {minutes(int(took))}",
            flush=True,
        )
        if code != 0:
            failed.append(name)
        summary[name] = (
            changes(name, old, read(name)) if code == 0 else [f"  failed (exit {code}): its output is above"]
        )
    print(f"\nWhat changed ({minutes(int(time.monotonic() - started))} in all):")
    for name, lines in summary.items():
        print(name)
        print("\n".join(lines))
    for page in docs_tables.write_all():
        print(f"rewrote {page.relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
