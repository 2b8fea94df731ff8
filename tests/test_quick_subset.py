"""The ``quick`` subset (tests/quick.py) still exists and still calls every public function and the demo."""

import importlib
import inspect
import re
from pathlib import Path

import pytest

import flashdora
from tests.quick import QUICK, is_quick

ROOT = Path(__file__).resolve().parents[1]


def _source(entry: str) -> str:
    """The source of a QUICK entry: the whole file, or the one test it names (an error if it is gone)."""
    path, _, name = entry.partition("::")
    assert (ROOT / path).is_file(), f"{entry}: no such file"
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    test = getattr(module, name.partition("[")[0], None) if name else None
    assert test is not None or not name, f"{entry}: no such test"
    # a file, or some parametrizations of a test (their helpers are in the file): the whole file; a test: itself
    return inspect.getsource(module if not name or "[" in name else test)


def test_every_entry_exists_and_every_public_function_is_called():
    text = "\n".join(_source(entry) for entry in QUICK if entry != "tests/test_quick_subset.py")
    public = [name for name in flashdora.__all__ if name != "__version__"]
    missing = [name for name in public if not re.search(rf"\b{name}\(", text)]
    assert not missing, f"the quick subset calls none of {missing}: add a test of them to tests/quick.py"
    assert re.search(r"main\(\[\s*\"demo\"|argv = \[\"demo\"", text), "the quick subset must run `flashdora demo`"


@pytest.mark.parametrize(
    "nodeid, quick",
    [
        ("tests/test_report.py::test_x", True),
        ("tests/test_cache_routes.py::test_route[data.copy_+invalidate-llama-eager]", True),
        ("tests/test_cache_routes.py::test_route[set_scale-llama-eager]", False),
        ("tests/test_docs.py::test_every_readme_snippet_runs_clean[flashdora.report(model)]", True),
        ("tests/test_examples.py::test_train_with_trainer_runs_flashdora", False),
        ("tests/test_report.pyc::test_x", False),
    ],
)
def test_is_quick(nodeid, quick):
    assert is_quick(nodeid) == quick
