"""Every record under bench/results/ carries its provenance (bench/provenance.py's schema), and the
check itself tells a good record from a bad one."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.provenance import ISAS, check_provenance, finish_provenance, git_checkout, start_provenance
from bench.stats import save_record

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
RECORDS = sorted(RESULTS.rglob("*.json"))


@pytest.mark.parametrize("path", RECORDS, ids=[str(p.relative_to(RESULTS)) for p in RECORDS])
def test_every_committed_record_carries_its_provenance(path: Path) -> None:
    record = json.loads(path.read_text())
    assert check_provenance(record) == [], f"{path}: rerun it with the benchmark's command, or delete it"


def _good() -> dict[str, Any]:
    """A fresh record, its start load set to an idle machine's: the suite's own services may keep
    this machine busier than a benchmark may start at, and that rule has its own test below."""
    record: dict[str, Any] = {
        "benchmark": "test",
        "provenance": finish_provenance(start_provenance(threads=1)),
    }
    record["provenance"]["load_average"]["start"] = [0.2, 0.1, 0.1]
    return record


def test_a_fresh_provenance_passes_and_describes_this_run() -> None:
    record = _good()
    assert check_provenance(record) == []
    provenance = record["provenance"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert provenance["commit"] == head.stdout.strip()
    assert provenance["machine"]["threads"] == 1
    # The native kernels load in this process, so the instruction set is one they choose.
    assert provenance["machine"]["isa"] in ISAS[:3]
    assert provenance["date"].endswith("+00:00")
    assert len(provenance["load_average"]["end"]) == 3
    assert provenance["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda p: p.pop("commit"), r"provenance\.commit is None"),
        (lambda p: p.update(commit="4a2c96f"), r"not a 40-hex commit"),
        (lambda p: p.update(dirty="no"), r"provenance\.dirty"),
        (lambda p: p.update(date="2026-12-02T01:23:45+01:00"), r"not in UTC"),
        (lambda p: p.update(date="yesterday"), r"not an ISO 8601 time"),
        (lambda p: p.update(command=[]), r"provenance\.command"),
        (lambda p: p["machine"].pop("isa"), r"provenance\.machine\.isa"),
        (lambda p: p["machine"].update(isa="sse2"), r"not one of avx512"),
        (lambda p: p["machine"].update(threads="2"), r"provenance\.machine\.threads"),
        (lambda p: p["load_average"].update(end=None), r"load_average\.end is None"),
        (lambda p: p["versions"].pop("torch"), r"versions\.torch is missing"),
        (lambda p: p["versions"].update(llama_cpp={"version": "1"}), r"llama_cpp lacks build_flags"),
    ],
)
def test_a_bad_provenance_is_named(change: Any, problem: str) -> None:
    record = _good()
    bad = copy.deepcopy(record)
    change(bad["provenance"])
    problems = check_provenance(bad)
    assert any(re.search(problem, text) for text in problems), problems
    assert check_provenance(record) == []


def test_a_timed_record_from_a_busy_machine_fails_unless_it_times_nothing() -> None:
    record = _good()
    cpus = record["provenance"]["machine"]["usable_cpus"]
    record["provenance"]["load_average"]["start"] = [cpus + 0.5, 1.0, 1.0]
    assert any("the machine was busy" in text for text in check_provenance(record))
    record["timed"] = False
    assert check_provenance(record) == []


def test_a_record_without_provenance_fails_and_save_record_fills_the_end(tmp_path: Path) -> None:
    assert check_provenance({"benchmark": "old", "machine": {"cpu_model": "x"}}) != []
    record: dict[str, Any] = {"benchmark": "test", "timed": False, "provenance": start_provenance()}
    assert record["provenance"]["load_average"]["end"] is None
    save_record(record, tmp_path / "record.json")
    assert check_provenance(json.loads((tmp_path / "record.json").read_text())) == []


def test_a_record_written_before_the_run_does_not_make_the_checkout_dirty(tmp_path: Path) -> None:
    """make bench-peer writes the perplexity record, then times the peer: the code measured is still
    the commit's, so only tracked files outside bench/results/ count as a dirty checkout."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True)
        return done.stdout.strip()

    git("init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "a.json").write_text("{}\n")
    (tmp_path / "code.py").write_text("one\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    (tmp_path / "bench" / "results" / "a.json").write_text('{"new": 1}\n')
    assert git_checkout(tmp_path) == (git("rev-parse", "HEAD"), False)
    (tmp_path / "code.py").write_text("two\n")
    assert git_checkout(tmp_path)[1] is True
