"""The log of one `make records` run: which records it reran, at which commit, how long each took.

A run of every quoted record takes longer than one sitting may have, so `make records` keeps its log
in bench/results/records-run.json, written after each record, and `--resume` continues it: it skips
the records the log already has done and reruns the rest, provided the code is still the code the
log's first sitting measured ("the same code": nothing differs between the two commits outside
bench/results/, docs/, tests/ and the markdown pages, so a commit of records or tables between
sittings keeps it). The log is whole when every record its run planned has a successful entry; the
records table in docs/benchmarks.md says so, with the run's minutes summed over its sittings.
This module owns the log's file and format and whether a sitting may continue it; it must not run a
benchmark.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from docs_tables_common import RESULTS, ROOT

if TYPE_CHECKING:
    from pathlib import Path

LOG_NAME = "records-run.json"
# What a record's figures cannot depend on: a commit that changes only these keeps the code the same.
NOT_CODE = (":(exclude)bench/results", ":(exclude)docs", ":(exclude)tests", ":(exclude)*.md")


def same_code(first: str, second: str, root: Path = ROOT) -> bool:
    """Whether the two commits hold the same code (they differ at most in records, docs and tests)."""
    diff = subprocess.run(
        ["git", "diff", "--quiet", first, second, "--", ".", *NOT_CODE], cwd=root, check=False
    )
    if diff.returncode > 1:
        raise SystemExit(f"git diff {first[:7]} {second[:7]} failed: is each a commit of this repository?")
    return diff.returncode == 0


@dataclass
class RunLog:
    """One run's log: the records it planned, in order, and an entry per record it ran."""

    planned: list[str]
    code: str
    sittings: int = 1
    runs: list[dict[str, Any]] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)

    def done(self) -> list[str]:
        """The planned records with a successful entry, in plan order."""
        ok = {run["record"] for run in self.runs if run["exit"] == 0}
        return [name for name in self.planned if name in ok]

    def remaining(self) -> list[str]:
        done = set(self.done())
        return [name for name in self.planned if name not in done]

    def whole(self) -> bool:
        return not self.remaining()

    def minutes(self) -> float:
        """Minutes the run's successful entries took, summed over its sittings."""
        return sum(int(run["seconds"]) for run in self.runs if run["exit"] == 0) / 60

    def add(self, record: str, commit: str, date: str, seconds: int, code: int) -> None:
        self.runs.append({"record": record, "commit": commit, "date": date, "seconds": seconds, "exit": code})

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": "records-run",
            # The log times no figure: its seconds say how long each rerun took, not how fast code ran.
            "timed": False,
            "provenance": self.provenance,
            "code": self.code,
            "sittings": self.sittings,
            "planned": self.planned,
            "runs": self.runs,
        }


def read_log(results: Path = RESULTS) -> RunLog | None:
    path = results / LOG_NAME
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return RunLog(
        planned=list(data["planned"]),
        code=str(data["code"]),
        sittings=int(data["sittings"]),
        runs=list(data["runs"]),
        provenance=dict(data["provenance"]),
    )


def write_log(log: RunLog, results: Path = RESULTS) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / LOG_NAME).write_text(json.dumps(log.to_json(), indent=2) + "\n")


def head_commit(root: Path = ROOT) -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def run_log(names: list[str], resume: bool, root: Path = ROOT, results: Path = RESULTS) -> RunLog:
    """The log this sitting writes: a fresh one for the whole list, or the one `--resume` continues
    (refused, naming the fix, when there is none or the code has changed since it began)."""
    head = head_commit(root)
    if not resume:
        return RunLog(planned=names, code=head)
    log = read_log(results)
    if log is None:
        raise SystemExit(
            f"--resume: there is no run to continue (bench/results/{LOG_NAME}): run `make records`"
        )
    if not same_code(log.code, head, root):
        raise SystemExit(
            f"--resume: the code changed since the run at {log.code[:7]} began, so its records and this "
            "sitting's would measure different code: run `make records` without --resume to start afresh"
        )
    log.sittings += 1
    return log


def summary(log: RunLog | None) -> str:
    """The records table's closing words about the last run (the docs quote it from the log)."""
    if log is None:
        return "`make records` has not yet been run whole."
    where = f"at the code of commit {log.code[:7]} (`bench/results/{LOG_NAME}`)"
    sittings = f"{log.sittings} sitting" + ("s" if log.sittings > 1 else "")
    if log.whole():
        return (
            f"`make records` last ran whole {where}: {len(log.planned)} records in {sittings}, "
            f"{log.minutes():.0f} minutes of runs in all."
        )
    return (
        f"`make records` is part-way through a run {where}: {len(log.done())} of {len(log.planned)} "
        f"records done in {sittings} ({log.minutes():.0f} minutes); `make records RECORDS_ARGS=--resume` "
        "reruns the rest."
    )
