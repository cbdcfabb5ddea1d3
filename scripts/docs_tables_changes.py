"""What a rerun changed: every figure of the tables a record feeds, before against after, cell by cell.

scripts/records.py prints this for each record it reran. A record a generated table reads is compared
by rendering its tables twice, with the record it replaced and with the new one (so the summary names
exactly the figures the docs show); a record quoted only in prose is compared ratio by ratio (its keys
naming a ratio: `ratio`, `_vs_`, `_over_`). This module must not write anything.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import docs_tables
import docs_tables_common
from docs_tables_common import Record

RATIO_KEYS = ("ratio", "_vs_", "_over_")


def read(name: str) -> dict[str, Any] | None:
    """The record as it is now under bench/results/, provenance or not."""
    path = docs_tables_common.RESULTS / name
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else None


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
