"""The library's modules import each other without circles.

Read from the source with ``ast``, not by importing: every ``import`` and ``from ... import`` of the three library
packages, at module level or inside a function (a function-level import is still a dependency, only a later one),
except those under ``if TYPE_CHECKING:`` (never executed). A name imported from a package counts as its submodule
where one exists (``from leapquant import parity``), else as the package's ``__init__``. Backends that the registry
loads by their entry-point string are plugins, not imports, and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("leapquant", "leapquant_triton", "leapquant_tilelang")


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """The Import and ImportFrom nodes of ``tree``, leaving out the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def import_graph() -> dict[str, set[str]]:
    """module -> the library modules it imports (names as ``leapquant.pool``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        deps = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest circle through each module that lies on one (empty when there is none)."""
    found = []
    for start in sorted(graph):
        # breadth-first from start's imports back to start
        prev = {d: start for d in graph[start]}
        frontier = sorted(graph[start])
        while frontier and start not in prev:
            nxt = []
            for m in frontier:
                for d in sorted(graph.get(m, ())):
                    if d not in prev:
                        prev[d] = m
                        nxt.append(d)
            frontier = nxt
        if start in prev:
            path, m = [start], prev[start]
            while m != start:
                path.append(m)
                m = prev[m]
            found.append([start] + path[1:][::-1] + [start])
    return found


def test_the_graph_sees_the_imports():
    """The analysis itself: it finds imports of each kind (a guard against a graph that is empty by mistake)."""
    g = import_graph()
    assert "leapquant.pool" in g["leapquant.ops"]  # from .pool import Pool
    assert "leapquant.backends" in g["leapquant_triton.backend"]  # from leapquant.backends import ...
    assert "leapquant.registry" in g["leapquant"]  # the package's __init__
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"], ["b", "c", "a", "b"],
                                                                         ["c", "a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_type_checking_imports_are_left_out():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .pool import Pool\n"
                     "def f():\n    from .ops import flush\n")
    assert [n.module for n in _imports(tree)] == ["typing", "ops"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(package):
    """No module of the package imports, directly or through others, a module that imports it back."""
    found = [c for c in cycles(import_graph()) if c[0].split(".")[0] == package]
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_core_is_a_leaf_of_the_pool():
    """Nothing that ``leapquant.pool`` imports, directly or through others, imports the pool: the geometry, the
    formulas, the checks, the backend protocol and the registry sit below it."""
    g = import_graph()
    below, todo = set(), list(g["leapquant.pool"])
    while todo:
        m = todo.pop()
        if m not in below:
            below.add(m)
            todo.extend(g[m])
    assert "leapquant.pool" not in below
    assert {"leapquant.geometry", "leapquant.formulas", "leapquant.checks", "leapquant.registry"} <= below


def test_public_names_are_in_all():
    """Every public function and class the package's ``__init__`` binds is in ``__all__`` (``accept`` once was not:
    ``from leapquant import *`` left it out), and every name of ``__all__`` exists."""
    import inspect

    import leapquant

    public = {n for n, o in vars(leapquant).items() if not n.startswith("_") and not inspect.ismodule(o)}
    assert public <= set(leapquant.__all__), sorted(public - set(leapquant.__all__))
    assert all(hasattr(leapquant, n) for n in leapquant.__all__)
    assert "accept" in leapquant.__all__
