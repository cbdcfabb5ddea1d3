"""The tables about the records themselves: when each was last run, at which commit, and how stale it is.

A record is stale when more than `STALE_AFTER` commits touched the paths its figures depend on
(docs_tables_catalog) since the commit its provenance names. The quoted records are those a
generated table reads plus those README.md and docs/*.md name in prose (`quoted_records`).
scripts/records.py uses the same functions for `--list` and `--stale`. This module must not run a
benchmark; it reads records, pages and git only.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from typing import TYPE_CHECKING

from docs_tables_catalog import CATALOG, LONG_RUNS
from docs_tables_common import RESULTS, ROOT, Record, Table, load, table
from records_log import LOG_NAME, read_log, summary

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from pathlib import Path

STALE_AFTER = 50
RELIABILITY = ROOT / "docs" / "reliability.md"
NAMED = re.compile(r"\b([a-z0-9][a-z0-9.-]*\.json)\b")


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def quoted_records(tables: Iterable[Table], root: Path = ROOT) -> list[str]:
    """Every record a generated table reads or a page names in prose, in catalog order, then the rest."""
    names = {name for spec in tables for name in spec.records}
    for page in pages(root):
        for name in NAMED.findall(page.read_text()):
            # The run log is make records' own bookkeeping, not a record it reruns.
            if name != LOG_NAME and (name in CATALOG or (RESULTS / name).exists()):
                names.add(name)
    ordered = [name for name in CATALOG if name in names]
    return ordered + sorted(names - set(ordered))


def rerunnable(names: Iterable[str]) -> list[str]:
    """Those `make records` reruns: all but those with a target of their own."""
    return [name for name in names if name not in CATALOG or CATALOG[name].target == "make records"]


def behind(commit: str, paths: Iterable[str]) -> int | None:
    """Commits since `commit` that touched `paths`; None when the commit is not in this repository."""
    known = subprocess.run(
        ["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True, check=False
    )
    if known.returncode != 0:
        return None
    out = subprocess.run(
        ["git", "rev-list", "--count", f"{commit}..HEAD", "--", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


def minutes(seconds: int) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds} s"


def _quotable(names: Iterable[str]) -> dict[str, Record | str]:
    out: dict[str, Record | str] = {}
    for name in names:
        record, why = load(name)
        out[name] = record if record is not None else why
    return out


def last_runs(names: list[str]) -> list[str]:
    rows = []
    total = 0
    quotable = _quotable(names)
    for name, record in quotable.items():
        entry = CATALOG.get(name)
        estimate = minutes(entry.estimate_s) if entry else "unknown"
        how = entry.target if entry else "make records"
        if entry and how == "make records":
            total += entry.estimate_s
        if isinstance(record, Record):
            rows.append([f"`{name}`", record.date, record.commit[:7], record.machine, estimate, how])
        else:
            rows.append([f"`{name}`", f"awaits a rerun ({record})", "-", "-", estimate, how])
    log = read_log()
    return [
        *table(["record", "last run", "commit", "machine", "estimated run time", "rerun by"], rows),
        "",
        f"`make records` reruns those marked so, one at a time: about {total / 60:.0f} minutes in all "
        f"by the estimates above. {summary(log)}{machines_of_run(log.done() if log else [], quotable)}",
    ]


def machines_of_run(done: list[str], quotable: Mapping[str, Record | str]) -> str:
    """Which machines the run's records, as they stand, ran on, when a sitting moved to another:
    their figures compare within a record, not across two machines."""
    machines = Counter(record.cpu for name in done if isinstance(record := quotable.get(name), Record))
    if len(machines) < 2:
        return ""
    parts = [f"{count} on {machine}" for machine, count in machines.items()]
    return f" Its records stand on {len(machines)} machines (the machine column): {'; '.join(parts)}."


def stale(names: list[str]) -> list[str]:
    rows = []
    for name, record in _quotable(names).items():
        entry = CATALOG.get(name)
        paths = entry.depends_on if entry else ("services/", "gateway/", "strata/")
        where = ", ".join(f"`{path}`" for path in paths)
        if not isinstance(record, Record):
            rows.append([f"`{name}`", where, "-", f"awaits a rerun ({record})"])
            continue
        count = behind(record.commit, paths)
        if count is None:
            rows.append(
                [f"`{name}`", where, "-", f"its commit {record.commit[:7]} is not in this repository"]
            )
        else:
            rows.append([f"`{name}`", where, str(count), "**stale**" if count > STALE_AFTER else "current"])
    return table(["record", "its figures depend on", "commits since its run", f"over {STALE_AFTER}?"], rows)


def long_runs(text: str | None = None) -> list[str]:
    """The long runs' table, from the reliability report's text (docs/reliability.md when None)."""
    if text is None:
        text = RELIABILITY.read_text() if RELIABILITY.exists() else ""
    report = re.search(r"^- Date: (.+)$", text, re.M)
    commit = re.search(r"^- Commit: (\S+) \((.+?)\)$", text, re.M)
    chaos = re.search(r"^\| 11 \|.*run alone on (.+? UTC)(?: at (\S+) \((.+?)\))?\)", text, re.M)
    whole = (report.group(1) if report else "not run", described(commit))
    rows = [
        [what, date, at, minutes(estimate), target]
        for (what, target, estimate), (date, at) in zip(
            LONG_RUNS, [whole, (chaos.group(1), described(chaos, 2)) if chaos else whole], strict=False
        )
    ]
    return table(["run", "last run", "commit", "estimated run time", "rerun by"], rows)


def described(match: re.Match[str] | None, first: int = 1) -> str:
    """A report's commit and tree as the runs table shows them; "not recorded" for an older report."""
    if not match or not match.group(first):
        return "not recorded"
    dirty = "dirty" in match.group(first + 1)
    return f"`{match.group(first)}`" + (" (dirty tree)" if dirty else "")


def runs_tables(names: Mapping[str, None] | list[str]) -> tuple[Table, ...]:
    listed = list(names)

    return (
        Table("records-runs", (), lambda _: last_runs(listed), partial=True, sources=False),
        Table("records-stale", (), lambda _: stale(listed), partial=True, volatile=True, sources=False),
        Table("long-runs", (), lambda _: long_runs(), partial=True, volatile=True, sources=False),
    )
