"""What every generated docs table shares: reading a record, the line naming it, number formats.

A record is a JSON file in bench/results/. It is quoted only when it carries a valid provenance
object (commit, dirty, date, command, ...): a record without one cannot be traced to the code that
made it, so its tables say it awaits a rerun instead. `Table` is the spec each page module declares:
its name (the marker's), the records it reads and the function that turns them into markdown lines.
This module must not know any page or any record's fields; the page modules (docs_tables_*.py) do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Record:
    """One record that can be quoted: its file name under bench/results/ and its JSON object."""

    name: str
    data: dict[str, Any]

    @property
    def provenance(self) -> dict[str, Any]:
        prov: dict[str, Any] = self.data["provenance"]
        return prov

    @property
    def commit(self) -> str:
        return str(self.provenance["commit"])

    @property
    def date(self) -> str:
        """The run's start, as `2026-12-01 14:50 UTC`."""
        return str(self.provenance["date"])[:16].replace("T", " ") + " UTC"

    @property
    def path(self) -> str:
        return f"bench/results/{self.name}"

    @property
    def cpu(self) -> str:
        """The CPU it ran on: figures of two records compare only when it is the same."""
        machine = self.provenance.get("machine")
        if not isinstance(machine, dict) or not machine.get("cpu_model"):
            return "machine not recorded"
        return str(machine["cpu_model"])

    @property
    def machine(self) -> str:
        """The CPU and the instruction set our kernels ran, as `AMD EPYC, native kernels avx512`."""
        machine = self.provenance.get("machine")
        isa = machine.get("isa") if isinstance(machine, dict) else None
        return f"{self.cpu}, native kernels {isa}" if isa else self.cpu

    def source_line(self) -> str:
        """`Record: path, commit abc1234, date, on AMD EPYC, native kernels avx512, load average 1.2 at
        start and 1.9 at end.`"""
        dirty = " (tracked files differed from it)" if self.provenance.get("dirty") else ""
        load = self.provenance.get("load_average")
        busy = ""
        if isinstance(load, dict) and load.get("start") and load.get("end"):
            busy = f", load average {load['start'][0]:.1f} at start and {load['end'][0]:.1f} at end"
        where = f"{self.date}, on {self.machine}"
        return f"Record: `{self.path}`, commit {self.commit[:7]}{dirty}, {where}{busy}."


def provenance_problems(data: object) -> list[str]:
    """Why a record cannot be quoted; empty when it can."""
    if not isinstance(data, dict):
        return ["is not a JSON object"]
    prov = data.get("provenance")
    if not isinstance(prov, dict):
        return ["has no provenance"]
    problems = []
    if not COMMIT.match(str(prov.get("commit", ""))):
        problems.append("names no 40-hex commit")
    if not isinstance(prov.get("date"), str):
        problems.append("has no date")
    if not isinstance(prov.get("command"), list) or not prov.get("command"):
        problems.append("has no command")
    return problems


def load(name: str, results: Path | None = None) -> tuple[Record | None, str]:
    """The record if it can be quoted, else None and why not (missing, unreadable, no provenance)."""
    path = (results or RESULTS) / name
    if not path.exists():
        return None, "does not exist"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        return None, f"is not valid JSON ({exc.msg}, line {exc.lineno})"
    problems = provenance_problems(data)
    if problems:
        return None, "; ".join(problems)
    return Record(name, data), ""


Render = Callable[[Mapping[str, Record]], list[str]]


@dataclass(frozen=True)
class Table:
    """A generated table: `render` gets the quotable ones of `records`, by file name."""

    name: str
    records: tuple[str, ...]
    render: Render
    partial: bool = False
    """Rendered even when some records cannot be quoted (each row names its own record)."""
    volatile: bool = False
    """Its figures come from git (commit counts), so they change with every commit, not with records."""
    sources: bool = True
    """Preceded by one line per record naming it, its commit and date."""


def awaits_line(reasons: Mapping[str, str], targets: Sequence[str] = ("make records",)) -> str:
    """The line that stands for a table whose records cannot be quoted, and how to rerun them."""
    names = ", ".join(f"`bench/results/{name}` ({why})" for name, why in reasons.items())
    how = " or ".join(f"`{target}`" for target in dict.fromkeys(targets))
    return f"Not quoted: {names}; it awaits a rerun by {how}."


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def num(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def ratio(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}x"


def spread(median: float, low_high: Sequence[float], digits: int = 1) -> str:
    """`146.6 (145.1-152.4)`: a median and the spread of its rounds."""
    low, high = low_high[0], low_high[-1]
    return f"{num(median, digits)} ({num(low, digits)}-{num(high, digits)})"


def stats(entry: Mapping[str, float], digits: int = 1, scale: float = 1.0) -> str:
    """A `{median, min/low, max/high}` entry as `median (min-max)`."""
    low = entry.get("min", entry.get("low"))
    high = entry.get("max", entry.get("high"))
    if low is None or high is None:
        return num(entry["median"] * scale, digits)
    return spread(entry["median"] * scale, [low * scale, high * scale], digits)


def runs(values: Sequence[float], digits: int = 2) -> str:
    return ", ".join(f"{value:.{digits}f}" for value in values)


def met(flag: object) -> str:
    if flag is True:
        return "met"
    return "**missed**" if flag is False else "-"
