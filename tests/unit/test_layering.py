"""The shared kernel's layering: strata/ imports no service, no gateway and no bench; and nothing the
package installs imports bench/, which it does not install.

Only strata/cli (the command line and the launcher, which start and drive everything) and strata/v1
(generated stubs) are exempt. The kernel must not import strata.cli either, since that would reach the
services through it. Every import counts wherever it is written: at module level, inside a function,
under `if TYPE_CHECKING:` (a type-only import still ties the kernel to a service for mypy and for its
readers), relative, or as a literal `importlib.import_module` / `__import__` call. The sources are read
with `ast`, never imported, so the check also covers code paths that no test runs. This module must
not import the modules it checks.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNEL = REPO_ROOT / "strata"
EXEMPT = frozenset({"cli", "v1"})
FORBIDDEN = ("services", "gateway", "bench", "strata.cli")
_IMPORT_CALLS = frozenset({"import_module", "__import__"})


def kernel_modules() -> list[Path]:
    """Every .py file of strata/ outside the exempt subpackages, sorted."""
    return sorted(path for path in KERNEL.rglob("*.py") if path.relative_to(KERNEL).parts[0] not in EXEMPT)


def module_name(path: Path, root: Path = REPO_ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from X import ...` reads from ("" for a relative one past the top)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 >= len(package):
        return node.module or ""
    kept = package[: len(package) - (node.level - 1)]
    return ".".join([*kept, node.module] if node.module else kept)


def imported_names(source: str, module: str, is_package: bool = False) -> Iterator[tuple[ast.AST, str]]:
    """(statement or call, module) for every module the source may import, in any scope.

    `from a import b` yields `a`, then `a.b`, since b may be a submodule (`from strata import cli`).
    """
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, module, is_package)
            if base:
                yield node, base
            for alias in node.names:
                if alias.name != "*":
                    yield node, f"{base}.{alias.name}" if base else alias.name
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if name in _IMPORT_CALLS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield node, first.value


def is_forbidden(name: str) -> bool:
    return any(name == layer or name.startswith(f"{layer}.") for layer in FORBIDDEN)


def forbidden_imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of each import that reaches a forbidden layer: its first forbidden name."""
    found: dict[ast.AST, str] = {}
    for node, name in imported_names(source, module, is_package):
        if is_forbidden(name):
            found.setdefault(node, name)
    return sorted((getattr(node, "lineno", 0), name) for node, name in found.items())


def violations(path: Path, root: Path = REPO_ROOT) -> list[str]:
    """'strata/x.py:LINE imports NAME' for each forbidden import of the module at `path` under `root`."""
    found = forbidden_imports(path.read_text(), module_name(path, root), path.name == "__init__.py")
    return [f"{path.relative_to(root)}:{line} imports {name}" for line, name in found]


@pytest.mark.parametrize("path", kernel_modules(), ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_a_kernel_module_imports_no_service_gateway_or_bench(path: Path) -> None:
    problems = violations(path)
    assert not problems, (
        f"{module_name(path)} must not import {', '.join(FORBIDDEN)} (only strata/cli may): "
        + "; ".join(problems)
    )


def test_the_scan_covers_the_kernel_and_skips_only_cli_and_v1() -> None:
    names = {module_name(path) for path in kernel_modules()}
    assert {"strata", "strata.client", "strata.probe", "strata.settings"} <= names
    assert not any(name.split(".")[1:2] in (["cli"], ["v1"]) for name in names)
    # The exemption is real: the command line does reach the services (the launcher's worker settings).
    launcher_config = KERNEL / "cli" / "stack_config.py"
    assert forbidden_imports(launcher_config.read_text(), "strata.cli.stack_config")


EVERY_FORM = """
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import servicesx
from strata import client
from strata.clinic import x

if TYPE_CHECKING:
    from services.worker.settings import WorkerSettings


def load():
    import gateway.server
    from .. import bench
    from strata import cli
    return importlib.import_module("services.tokenizer"), __import__("bench.stack")
"""


def test_the_check_sees_imports_in_every_scope_and_form() -> None:
    assert forbidden_imports(EVERY_FORM, "strata.every_form") == [
        (12, "services.worker.settings"),
        (16, "gateway.server"),
        (17, "bench"),
        (18, "strata.cli"),
        (19, "bench.stack"),
        (19, "services.tokenizer"),
    ]


def test_a_violation_names_the_file_line_and_import(tmp_path: Path) -> None:
    module = tmp_path / "strata" / "pkg" / "__init__.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from ..cli import launcher\n")
    assert violations(module, tmp_path) == ["strata/pkg/__init__.py:2 imports strata.cli"]


def product_modules() -> list[Path]:
    """Every .py file of what the package installs: strata/, services/, gateway/ (generated stubs aside)."""
    roots = (KERNEL, REPO_ROOT / "services", REPO_ROOT / "gateway")
    return sorted(
        p for root in roots for p in root.rglob("*.py") if "v1" not in p.relative_to(REPO_ROOT).parts
    )


BENCH_COMMAND = KERNEL / "cli" / "__init__.py"
"""`strata bench`'s handler: the one product module that reaches bench/, lazily, from a checkout."""


def test_no_product_module_imports_bench_and_bench_is_not_installed() -> None:
    """bench/ is a tool: nothing the package installs imports it (but the `strata bench` command, inside
    its handler), and pyproject.toml does not install it."""
    problems = []
    for path in product_modules():
        names = imported_names(path.read_text(), module_name(path), path.name == "__init__.py")
        found = [(getattr(node, "lineno", 0), name) for node, name in names if name.split(".")[0] == "bench"]
        if path == BENCH_COMMAND:
            tree = ast.parse(path.read_text())
            top_level = {getattr(node, "lineno", 0) for node in tree.body}
            found = [(line, name) for line, name in found if line in top_level]
        problems += [f"{path.relative_to(REPO_ROOT)}:{line} imports {name}" for line, name in found]
    assert not problems, problems
    include = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
        "find"
    ]
    assert not [pattern for pattern in include["include"] if pattern.startswith("bench")]
