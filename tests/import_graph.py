"""A static import graph of one package, and its cycles (tests/test_import_cycles.py).

Reads the source with ``ast``; imports nothing it analyzes. An edge is one import of a module of the package by
another:

- ``import a.b`` and ``from a import b`` (``b`` a submodule) name the module ``a.b``; ``from a.b import name``
  names ``a.b``; relative imports are resolved against the importing module;
- ``importlib.import_module("a.b")`` with a literal name counts as ``import a.b``;
- an import inside a function (``def``, ``lambda``) is a *deferred* edge, any other (module body, class body,
  ``if``/``try`` at module level) a *module-level* one; both are counted: an import deferred only to dodge a cycle
  is still a cycle in the design;
- importing ``a.b.c`` also runs ``a/b/__init__.py``: that implicit edge to each enclosing package is drawn too
  (Python runs it), except from a module inside that package (its ``__init__`` is already running) and to the top
  package (``flashdora/__init__.py`` imports nothing eagerly).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple


class Edge(NamedTuple):
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    line: int
    deferred: bool  # inside a function


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every ``.py`` under the package directory ``root`` (``__init__`` names the package)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest dotted prefix of ``name`` that is a module of the package, or None (an outside import)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _base(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The module a ``from ... import`` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, node.module] if node.module else package)


def _targets(module: str, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    """Dotted names of the modules one import node names (unresolved; outside modules included)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _base(module, node, modules[module].name == "__init__.py")
        return sorted({f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names})
    if (  # importlib.import_module("literal") / import_module("literal")
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def _walk(node: ast.AST, deferred: bool = False):
    """Every node under ``node`` with whether it sits inside a function."""
    for child in ast.iter_child_nodes(node):
        inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield child, inner
        yield from _walk(child, inner)


def import_edges(root: Path) -> list[Edge]:
    """Every import of one module of the package by another, in file and line order."""
    modules = module_names(root)
    edges = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, deferred in _walk(tree):
            for name in _targets(module, node, modules):
                target = _resolve(name, modules)
                if target is not None and target != module:
                    edges.append(Edge(module, target, node.lineno, deferred))
                    parts = target.split(".")
                    for i in range(2, len(parts)):  # the enclosing packages' __init__, which Python runs first
                        package = ".".join(parts[:i])
                        if package in modules and package != module and not module.startswith(package + "."):
                            edges.append(Edge(module, package, node.lineno, deferred))
    return edges


def cycles(edges: list[Edge], deferred: bool = True) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one module (sorted names), sorted; Tarjan's algorithm.

    ``deferred=False`` keeps only module-level edges: the cycles Python itself would meet at import time.
    """
    graph: dict[str, set[str]] = {}
    for edge in edges:
        if deferred or not edge.deferred:
            graph.setdefault(edge.source, set()).add(edge.target)
            graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:  # recursion depth is bounded by the package's module count
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def cycle_edges(edges: list[Edge], component: tuple[str, ...]) -> list[Edge]:
    """The edges inside one component: the imports to move to break it."""
    members = set(component)
    return [e for e in edges if e.source in members and e.target in members]
