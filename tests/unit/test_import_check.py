"""strata.import_check, the images' last build step: every module of a package is imported, a module
whose dependency is missing is named with its error and counted in the exit code, and `__main__`
modules are never run. A package made here, with one module that imports what is not installed."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

from strata import import_check

if TYPE_CHECKING:
    from pathlib import Path


def _package(root: Path) -> None:
    package = root / "probe_pkg"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "fine.py").write_text("import json\n")
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "needs_more.py").write_text("import no_such_dependency\n")
    # Would fail the check (and exit) if it were imported.
    (package / "__main__.py").write_text("raise SystemExit(7)\n")


def test_every_module_is_imported_and_a_missing_dependency_is_named(tmp_path: Path) -> None:
    _package(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        assert set(import_check.modules("probe_pkg")) == {
            "probe_pkg",
            "probe_pkg.fine",
            "probe_pkg.inner",
            "probe_pkg.inner.needs_more",
        }
        imported, failures = import_check.check(["probe_pkg"])
        assert imported == 3
        assert failures == [
            "probe_pkg.inner.needs_more: ModuleNotFoundError: No module named 'no_such_dependency'"
        ]
        assert import_check.check(["probe_pkg"], skip=("probe_pkg.inner",)) == (2, [])
    finally:
        sys.path.remove(str(tmp_path))
        for name in [name for name in sys.modules if name.startswith("probe_pkg")]:
            del sys.modules[name]


def test_the_command_fails_the_build_with_the_count_of_failures(tmp_path: Path) -> None:
    _package(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "strata.import_check", "probe_pkg"],
        capture_output=True,
        text=True,
        check=False,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "probe_pkg.inner.needs_more: ModuleNotFoundError" in done.stderr
    assert "import check: 3 modules imported, 1 failed (probe_pkg)" in done.stdout
