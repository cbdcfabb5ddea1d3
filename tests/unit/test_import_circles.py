"""No import circles: a module never reaches itself through the modules it imports.

A circle means two modules cannot be read, tested or replaced apart, and the layer below knows the
layer above. Every import counts, as in test_layering.py (whose AST reader this test shares):
`TYPE_CHECKING` ones included, since a type-only import ties the modules together for mypy and for
their readers as much as a run-time one. The sources are read, never imported. Where two modules
need each other's types, the lower one states what it needs as a Protocol (credits.py's CreditLink)
or the values they share move to a module below both (gateway/request_values.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.unit.test_layering import REPO_ROOT, imported_names, module_name

if TYPE_CHECKING:
    from pathlib import Path

PACKAGES = ("strata", "services", "gateway")


def import_graph(root: Path = REPO_ROOT) -> dict[str, set[str]]:
    """Module -> the modules of PACKAGES it imports (generated protobuf stubs left out)."""
    paths = {
        module_name(path, root): path
        for package in PACKAGES
        for path in (root / package).rglob("*.py")
        if "v1" not in path.relative_to(root).parts
    }
    return {
        name: {
            target
            for _, target in imported_names(path.read_text(), name, path.name == "__init__.py")
            if target in paths and target != name
        }
        for name, path in paths.items()
    }


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root, first in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(first)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_finder_sees_a_type_only_circle() -> None:
    """Three modules in a ring and one pointing into it: one circle of three; a chain: none."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_type_checking_imports() -> None:
    """The model runner imports the scheduled batch's type only under TYPE_CHECKING: the edge is in
    the graph, and the graph holds every module of the three packages."""
    graph = import_graph()
    assert "services.worker.engine.sequence" in graph["services.worker.engine.model_runner"]
    assert len(graph) > 150


def test_no_import_circle_in_strata_services_or_gateway() -> None:
    found = [sorted(circle) for circle in circles(import_graph())]
    assert not found, f"import circles: {found}: move the shared values to a lower module"
