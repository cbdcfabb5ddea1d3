"""`make records` over more than one sitting: `--minutes` ends a sitting between records, the run's
log (scripts/records_log.py) keeps what each sitting reran, `--resume` reruns only the rest, and only
while the code is the code the run began on. Real git trees in tmp_path and real child processes for
the records' commands; the commands are stand-ins that write a file, since no benchmark's figures are
under test here, only which records run and what the log says."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
WRITER = (
    "import pathlib, sys, time; pathlib.Path('bench/results', sys.argv[1]).write_text(str(time.time_ns()))"
)
NAMES = ["a.json", "b.json", "c.json"]


@pytest.fixture(scope="module")
def records() -> Any:
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("records_under_test", SCRIPTS / "records.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(tree: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def _commit_all(tree: Path, message: str) -> str:
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", message)
    return _git(tree, "rev-parse", "HEAD")


@pytest.fixture
def tree(tmp_path: Path, records: Any, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository with code and an empty bench/results/, and make records pointed at three stand-in
    records (b's estimate set by each test)."""
    root = tmp_path / "repo"
    (root / "bench" / "results").mkdir(parents=True)
    (root / "bench" / "results" / ".keep").write_text("")
    (root / "measured.py").write_text("a = 1\n")
    _git(root, "init", "-q")
    _commit_all(root, "first")
    monkeypatch.setattr(records, "ROOT", root)
    monkeypatch.setattr(records, "quoted_records", lambda tables: list(NAMES))
    monkeypatch.setattr(records, "rerunnable", list)
    monkeypatch.setattr(records, "command", lambda name: [sys.executable, "-c", WRITER, name])
    monkeypatch.setattr(records, "read", lambda name: None)
    monkeypatch.setattr(records, "changes", lambda name, old, new: ["  rerun"])
    monkeypatch.setattr(records.docs_tables, "write_all", list)
    monkeypatch.setattr(
        records,
        "start_provenance",
        lambda: {"commit": _git(root, "rev-parse", "HEAD"), "load_average": {"start": [0.0] * 3}},
    )
    return root


def _estimates(records: Any, monkeypatch: pytest.MonkeyPatch, b_seconds: int) -> None:
    monkeypatch.setattr(records, "estimate", lambda name: b_seconds if name == "b.json" else 0)


def test_a_sitting_ends_before_a_record_that_would_overrun_and_resume_runs_only_the_rest(
    tree: Path, records: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _git(tree, "rev-parse", "HEAD")
    log_module = sys.modules["records_log"]
    _estimates(records, monkeypatch, b_seconds=10**6)
    assert records.main(["--minutes", "1", "--max-load", "1e9"]) == 0
    results = tree / "bench" / "results"
    assert sorted(p.name for p in results.glob("?.json")) == ["a.json"]
    log = log_module.read_log(results)
    assert (log.planned, log.done(), log.sittings) == (NAMES, ["a.json"], 1)
    assert "1 of 3 records done in 1 sitting" in log_module.summary(log)
    assert "RECORDS_ARGS=--resume" in log_module.summary(log)

    # The records are committed between sittings: a new HEAD, the same code.
    a_before = (results / "a.json").read_text()
    _commit_all(tree, "records of the first sitting")
    _estimates(records, monkeypatch, b_seconds=0)
    assert records.main(["--resume", "--max-load", "1e9"]) == 0
    assert (results / "a.json").read_text() == a_before, "--resume reran a record the log had done"
    assert sorted(p.name for p in results.glob("?.json")) == NAMES
    log = log_module.read_log(results)
    assert log.whole() and log.sittings == 2 and log.code == first
    assert [run["record"] for run in log.runs] == NAMES
    assert log_module.summary(log).startswith(
        f"`make records` last ran whole at the code of commit {first[:7]}"
    )
    assert "3 records in 2 sittings" in log_module.summary(log)


def test_resume_refuses_when_the_code_changed_or_there_is_no_run(
    tree: Path, records: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _estimates(records, monkeypatch, b_seconds=10**6)
    with pytest.raises(SystemExit, match="there is no run to continue"):
        records.main(["--resume", "--max-load", "1e9"])
    assert records.main(["--minutes", "1", "--max-load", "1e9"]) == 0
    (tree / "measured.py").write_text("a = 2\n")
    _commit_all(tree, "a code change")
    with pytest.raises(SystemExit, match=r"the code changed since the run at .* without --resume"):
        records.main(["--resume", "--max-load", "1e9"])


def test_only_records_docs_and_tests_may_change_between_sittings(tree: Path, records: Any) -> None:
    same_code = sys.modules["records_log"].same_code
    first = _git(tree, "rev-parse", "HEAD")
    for path in ("bench/results/r.json", "docs/page.md", "tests/test_x.py", "README.md"):
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(json.dumps(path))
    assert same_code(first, _commit_all(tree, "records, docs and tests"), tree)
    (tree / "measured.py").write_text("a = 3\n")
    assert not same_code(first, _commit_all(tree, "code"), tree)
