"""No import cycles inside flashdora: every import of one flashdora module by another, at module level or inside a
function (an import deferred only to dodge a cycle is still a cycle), drawn by ``tests/import_graph.py``."""

import shutil
from pathlib import Path

from tests.import_graph import Edge, cycle_edges, cycles, import_edges

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "flashdora"

# Cycles that stay for now, each with the reason; nothing else may form one.
ALLOWED: dict[tuple[str, ...], str] = {}  # (cycle's modules, sorted): why it stays


def unexpected_cycles(root: Path) -> list[str]:
    """Each cycle of the package at ``root`` that ``ALLOWED`` does not name, with the imports that close it."""
    edges = import_edges(root)
    found = []
    for component in cycles(edges):
        if component not in ALLOWED:
            imports = "; ".join(
                f"{e.source} -> {e.target} (line {e.line}{', in a function' if e.deferred else ''})"
                for e in cycle_edges(edges, component)
            )
            found.append(f"{' <-> '.join(component)}: {imports}")
    return found


def test_no_import_cycles():
    found = unexpected_cycles(PACKAGE)
    assert not found, "import cycles (move the shared code down a level instead):\n" + "\n".join(found)


def test_every_allowed_cycle_still_exists():
    """An allowance whose cycle is gone goes too, so that the cycle cannot come back unnoticed."""
    found = set(cycles(import_edges(PACKAGE)))
    stale = [f"{c}: {why}" for c, why in ALLOWED.items() if c not in found]
    assert not stale, "no longer a cycle, remove it from ALLOWED:\n" + "\n".join(stale)


def test_a_new_cycle_fails(tmp_path):
    """The check above on a copy of the package with one deferred import added that closes a cycle."""
    root = tmp_path / "flashdora"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    common = root / "kernels" / "_common.py"  # (kernels/dequant.py imports it)
    late = "\n\ndef _late():\n    from flashdora.kernels import dequant\n\n    return dequant\n"
    common.write_text(common.read_text() + late)
    found = unexpected_cycles(root)
    assert len(found) == 1 and found[0].startswith("flashdora.kernels._common <-> flashdora.kernels.dequant:"), found
    assert "flashdora.kernels._common -> flashdora.kernels.dequant (line" in found[0] and "in a function" in found[0]


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_analyzer_on_a_small_package(tmp_path):
    """Absolute, relative, ``from package import module``, ``import_module("...")`` and deferred imports; outside
    modules and self-imports drawn as nothing."""
    root = tmp_path / "pkg"
    _write(
        root,
        {
            "__init__.py": "import importlib\nimportlib.import_module('pkg.c')\n",
            "a.py": "import os\nfrom pkg import b\nfrom . import c as renamed\n",
            "b.py": "import pkg.a\n\n\ndef f():\n    from .sub import d\n    from pkg.sub.d import thing\n",
            "c.py": "from pkg.c import x\nimport torch\n",
            "sub/__init__.py": "",
            "sub/d.py": "from .. import a\nfrom ..c import name\nfrom pkg import sub\n\nclass K:\n    import pkg.b\n",
        },
    )
    edges = import_edges(root)
    assert set(edges) == {
        Edge("pkg", "pkg.c", 2, False),
        Edge("pkg.a", "pkg.b", 2, False),
        Edge("pkg.a", "pkg.c", 3, False),
        Edge("pkg.b", "pkg.a", 1, False),
        Edge("pkg.b", "pkg.sub.d", 5, True),
        Edge("pkg.b", "pkg.sub", 5, True),  # (importing pkg.sub.d runs pkg/sub/__init__.py first)
        Edge("pkg.b", "pkg.sub.d", 6, True),
        Edge("pkg.b", "pkg.sub", 6, True),
        Edge("pkg.sub.d", "pkg.a", 1, False),
        Edge("pkg.sub.d", "pkg.c", 2, False),
        Edge("pkg.sub.d", "pkg.sub", 3, False),
        Edge("pkg.sub.d", "pkg.b", 6, False),  # a class body runs at import: module level
    }
    assert cycles(edges) == [("pkg.a", "pkg.b", "pkg.sub.d")]  # a -> b -> (deferred) d -> a
    assert cycles(edges, deferred=False) == [("pkg.a", "pkg.b")]
    assert {(e.source, e.target) for e in cycle_edges(edges, ("pkg.a", "pkg.b"))} == {
        ("pkg.a", "pkg.b"),
        ("pkg.b", "pkg.a"),
    }


def test_analyzer_finds_no_cycle_in_a_chain(tmp_path):
    root = tmp_path / "pkg"
    files = {"__init__.py": "", "a.py": "from pkg import b\n", "b.py": "def f():\n    from pkg import c\n", "c.py": ""}
    _write(root, files)
    edges = import_edges(root)
    assert len(edges) == 2 and cycles(edges) == []


def test_a_cycle_through_a_package_init_is_found(tmp_path):
    """``a`` imports ``pkg.sub.d``, which runs ``pkg/sub/__init__.py``, which imports ``pkg.sub.e``, which imports
    ``a``: a cycle Python meets although no module names another's importer (the cycle the C++ bridge had through
    ``ops/__init__.py``)."""
    root = tmp_path / "pkg"
    files = {
        "__init__.py": "", "a.py": "from pkg.sub.d import f\n", "sub/__init__.py": "from pkg.sub.e import g\n",
        "sub/d.py": "def f():\n    pass\n", "sub/e.py": "from pkg import a\n",
    }  # fmt: skip
    _write(root, files)
    assert cycles(import_edges(root)) == [("pkg.a", "pkg.sub", "pkg.sub.e")]
