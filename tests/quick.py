"""The ``quick`` subset (``bash scripts/test.sh --quick``, or ``pytest -m quick``): every public function and the
demo, on the CPU in a few minutes. tests/conftest.py marks these; tests/test_quick_subset.py checks that they still
exist and still reach every public function.

An entry is a test file (every test in it), one test (``file::name``, every parametrization of it) or the start of
some parametrizations' ids (``file::name[start``).
"""

QUICK = [
    "tests/test_reference.py",  # the float64 reference the rest is judged by
    "tests/ops/test_norm.py",  # factored_norm
    "tests/ops/test_compose.py",  # dora_linear
    "tests/test_cache_routes.py::test_route[data.copy_+invalidate-",  # invalidate after a write behind autograd
    "tests/test_peft_integration.py",  # enable, disable, patch_peft, unpatch_peft; save and load with plain PEFT
    "tests/test_peft_enable_check.py",  # enable on a model with nothing to switch
    "tests/test_pickle_old_modules.py",  # models saved before the move to flashdora.peft still load
    "tests/test_report.py",  # stats, reset_stats, report
    "tests/test_backend.py",  # FLASHDORA_BACKEND, configure
    "tests/test_double_backward.py::test_without_double_backward_create_graph_is_refused",  # double_backward
    "tests/test_cli.py",  # flashdora demo and the option checks
    "tests/test_docs.py",  # the README's and docs' links and linked numbers; every README snippet runs clean
    "tests/test_quick_subset.py",
]


def is_quick(nodeid: str) -> bool:
    """Whether a pytest node id (``tests/x.py::test_y[param]``) falls under an entry of ``QUICK``."""
    return any(
        nodeid == q or nodeid.startswith((q + "::", q + "[")) or ("[" in q and nodeid.startswith(q)) for q in QUICK
    )
