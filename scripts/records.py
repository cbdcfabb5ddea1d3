"""Rerun, at HEAD, every record README.md and docs/ quote, then regenerate the docs' tables from them.

`make records` runs this. The records are those a generated table reads (scripts/docs_tables.py) plus
those a page names in prose; each reruns by the command its provenance stores (the catalog's,
scripts/docs_tables_catalog.py, where it stores none), one at a time, with a progress line each, in a
clean checkout of HEAD beside the tree (a git worktree with the tree's .venv and models/ linked in,
its own code first on PYTHONPATH), so that every record names HEAD and a clean tree: what a run
writes under bench/results/ is copied back into the tree, then the worktree's bench/results/ is put
back to HEAD, so the next record finds it clean too. At
the end it says, record by record, what changed against the record it replaced: every figure of the
tables that record feeds, cell by cell, or for a record quoted only in prose its ratios, key by key.
Then it rewrites the tables. It refuses to start on a tree whose tracked files differ from HEAD (a
record names the commit it measured) or on a busy machine (the figures would measure the neighbours).

`--list` prints what it would run and each record's estimated run time; `--only NAME[,NAME...]` runs
those, in the order given (the most quoted first, when a session has less time than the whole list);
`--stale` lists the records more than 50 commits behind HEAD in the paths they measure. A run of the
whole list keeps its log (scripts/records_log.py) after each record; `--resume` continues it in a
later sitting while the code is the same, and `--minutes N` starts no record whose estimate would
end it past N minutes, so a sitting ends between records. A record with a target of its own is left
to it, and a dropped lever's record is not rerun (its script is at its commit); the reliability
report and the chaos soak have targets of their own (`make reliability`, `make chaos`).
This module runs the benchmarks' own commands and must not time or judge anything itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import docs_tables
from docs_tables_catalog import CATALOG
from docs_tables_changes import changes, read
from docs_tables_common import ROOT
from docs_tables_runs import STALE_AFTER, behind, minutes, quoted_records, rerunnable
from records_log import LOG_NAME, RunLog, run_log, write_log

from bench.provenance import finish_provenance, start_provenance

if TYPE_CHECKING:
    from collections.abc import Iterator

DEFAULT_MAX_LOAD = 0.5 * (
    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)
SETTLE_S = 180.0


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


@contextmanager
def head_checkout(root: Path) -> Iterator[Path]:
    """A clean worktree of `root`'s HEAD, with its .venv and models/ linked in; removed on the way out."""
    tree = Path(tempfile.mkdtemp(prefix="strata-records-")) / "tree"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), "HEAD"], cwd=root, check=True, capture_output=True
    )
    try:
        for shared in (".venv", "models"):
            if (root / shared).exists():
                (tree / shared).symlink_to(root / shared)
        yield tree
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(tree)], cwd=root, check=True, capture_output=True
        )
        shutil.rmtree(tree.parent, ignore_errors=True)


def run_in(tree: Path, argv: list[str]) -> int:
    """Run a record's command in the worktree, its code ahead of the installed checkout's."""
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(argv, cwd=tree, env={**os.environ, "PYTHONPATH": path}, check=False).returncode


def restore(tree: Path) -> None:
    """Put the worktree's bench/results/ back to HEAD: the next record must find a clean tree, and a
    record the last run rewrote there would make it dirty (its provenance would say so)."""
    subprocess.run(["git", "checkout", "--", "bench/results"], cwd=tree, check=True, capture_output=True)
    subprocess.run(["git", "clean", "-fdq", "--", "bench/results"], cwd=tree, check=True, capture_output=True)


def snapshot(tree: Path) -> dict[Path, tuple[int, int]]:
    """Each file under the worktree's bench/results/ with its modification time and size."""
    results = tree / "bench" / "results"
    return {
        path: (path.stat().st_mtime_ns, path.stat().st_size) for path in results.rglob("*") if path.is_file()
    }


def copy_back(tree: Path, root: Path, before: dict[Path, tuple[int, int]]) -> list[str]:
    """Copy into the tree what a run wrote under bench/results/ since `before`; the files' names.

    Only what the run wrote: a record someone changed in the tree meanwhile is left alone otherwise.
    """
    copied = []
    for path, stat in sorted(snapshot(tree).items()):
        if before.get(path) == stat:
            continue
        dest = root / path.relative_to(tree)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
        copied.append(str(dest.relative_to(root)))
    return copied


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


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print what would run, with estimated run times")
    parser.add_argument(
        "--only",
        metavar="NAME[,NAME...]",
        help="rerun these records, in this order (file names under bench/results/); keeps no run log",
    )
    parser.add_argument(
        "--stale", action="store_true", help=f"list records more than {STALE_AFTER} commits behind HEAD"
    )
    parser.add_argument(
        "--resume", action="store_true", help=f"continue the run bench/results/{LOG_NAME} logs"
    )
    parser.add_argument(
        "--minutes", type=float, help="start no record whose estimate would end past this many minutes"
    )
    parser.add_argument(
        "--max-load", type=float, default=DEFAULT_MAX_LOAD, help="refuse above this 1-minute load average"
    )
    args = parser.parse_args(argv)
    if args.resume and args.only:
        parser.error("--resume continues the whole list's run; --only runs records outside it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    quoted = quoted_records(docs_tables.RECORD_TABLES)
    names = rerunnable(quoted)
    if args.only:
        chosen = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in names]
        if unknown:
            raise SystemExit(
                f"--only {', '.join(unknown)}: not a record the docs quote and that can be rerun; "
                "`--list` shows them"
            )
        names = chosen
    if args.stale:
        lines = stale_lines(quoted)
        print("\n".join(lines) if lines else f"no record is more than {STALE_AFTER} commits behind HEAD")
        return 0
    if args.list:
        for name in names:
            print(f"{name}  ~{minutes(estimate(name))}  {' '.join(command(name))}")
        for name in sorted(set(quoted) - set(rerunnable(quoted))):
            print(f"{name}  not rerun here: by `{CATALOG[name].target}`")
        print(f"total: about {sum(map(estimate, names)) / 60:.0f} minutes (an estimate)")
        return 0
    reason = refuse_reason(args.max_load)
    if reason:
        print(f"make records: not started: {reason}", file=sys.stderr)
        return 2
    log = None if args.only else run_log(names, args.resume, ROOT, ROOT / "bench" / "results")
    if log is not None:
        names = log.remaining()
    return run_records(names, log, args)


def run_records(names: list[str], log: RunLog | None, args: argparse.Namespace) -> int:
    """Rerun `names` one at a time, logging each in `log` (None: keep no log); then the summary."""
    summary: dict[str, list[str]] = {}
    failed: list[str] = []
    started = time.monotonic()
    provenance = start_provenance()
    with head_checkout(ROOT) as tree:
        for index, name in enumerate(names, 1):
            if index > 1:
                settle(args.max_load)
            spent = time.monotonic() - started
            if args.minutes is not None and spent + estimate(name) > args.minutes * 60:
                print(
                    f"stopped before {name} (about {minutes(estimate(name))}): it would end past "
                    f"--minutes {args.minutes:g}; {len(names) - index + 1} records remain for "
                    "`make records RECORDS_ARGS=--resume`",
                    flush=True,
                )
                break
            argv_run = command(name)
            progress = f"[{index}/{len(names)}] {name}"
            print(f"{progress}: {' '.join(argv_run)} (about {minutes(estimate(name))})", flush=True)
            old = read(name)
            date = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
            begin, before = time.monotonic(), snapshot(tree)
            code = run_in(tree, argv_run)
            copied = copy_back(tree, ROOT, before)
            restore(tree)
            seconds = int(time.monotonic() - begin)
            outcome = "done" if code == 0 else f"FAILED (exit {code})"
            wrote = ", ".join(copied) or "nothing"
            print(f"{progress}: {outcome} in {minutes(seconds)}; wrote {wrote}", flush=True)
            if log is not None:
                log.add(name, provenance["commit"], date, seconds, code)
                log.provenance = finish_provenance(provenance)
                write_log(log, ROOT / "bench" / "results")
            if code != 0:
                failed.append(name)
            summary[name] = (
                changes(name, old, read(name))
                if code == 0
                else [f"  failed (exit {code}): its output is above"]
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
