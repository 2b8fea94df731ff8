import atexit
import os
import shutil
import tempfile

# pytest-xdist workers share the machine's cores: each gets its share for torch's (OpenMP) and numpy's (OpenBLAS)
# threads, and so do the processes a test starts (they inherit the variables). With every worker on all cores the
# threads outnumber the cores and OpenMP's waiting threads spin: the small ops of these tests ran 4-8x slower.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _threads = str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, _threads)

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A fresh inductor cache per test session: a cached graph from an older flashdora can call a custom op with an old
# schema (seen here: compose_bwd after it gained an argument), and torch's FX graph cache key does not see that.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashdora-inductor-")
atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

# The Triton interpreter must be chosen before triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from flashdora import config  # noqa: E402
from tests.quick import is_quick  # noqa: E402


class _ConfigMonkeyPatch(pytest.MonkeyPatch):
    """``monkeypatch`` whose ``setenv``/``delenv`` of a ``FLASHDORA_*`` variable (and ``undo``) re-read flashdora's
    settings, as a new process would at import: flashdora reads the environment once (``config``)."""

    def setenv(self, name, value, prepend=None):
        super().setenv(name, value, prepend)
        if name.startswith("FLASHDORA_"):
            config.reload()

    def delenv(self, name, raising=True):
        super().delenv(name, raising)
        if name.startswith("FLASHDORA_"):
            config.reload()

    def undo(self):
        super().undo()
        config.reload()


@pytest.fixture
def monkeypatch():
    patch = _ConfigMonkeyPatch()
    yield patch
    patch.undo()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA (run `pytest -m gpu` on a GPU machine)")
    skip2 = pytest.mark.skip(reason="needs two CUDA devices (run `pytest -m gpu2` on a two-GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        if "gpu2" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(skip2)
        if is_quick(item.nodeid):
            item.add_marker(pytest.mark.quick)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist (``scripts/test.sh -n``): a worker's routes, for the check at the end of the session."""
    seen = getattr(node, "workeroutput", {}).get("flashdora_seen", [])
    node.config.stash.setdefault(_WORKERS_SEEN, set()).update(tuple(route) for route in seen)


_WORKERS_SEEN = pytest.StashKey[set]()


def pytest_sessionfinish(session, exitstatus):
    """Every route a call took in this session is in docs/design.md's route table (tests/test_routes.py); under
    pytest-xdist each worker hands its routes to the controller, which checks them all."""
    from flashdora import dispatch
    from tests.test_routes import unlisted

    if hasattr(session.config, "workerinput"):
        session.config.workeroutput["flashdora_seen"] = [list(route) for route in dispatch.SEEN]
        return
    bad = unlisted(dispatch.SEEN | session.config.stash.get(_WORKERS_SEEN, set()))
    if bad:
        print(f"\nflashdora: routes taken that docs/design.md's route table does not list: {sorted(bad)}")
        session.exitstatus = 1


@pytest.fixture(autouse=True)
def _seed_and_clean_state(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.delenv("FLASHDORA_BACKEND", raising=False)
    yield


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned_empty(monkeypatch):
    """``torch.empty`` and ``torch.empty_like`` that fill floating outputs with NaN, so an element a kernel forgets to
    write shows up."""

    def poisoned(factory):
        def nan_factory(*args, **kwargs):
            t = factory(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        return nan_factory

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))


@pytest.fixture
def no_command_runs(monkeypatch):
    """``flashdora.tools.cli.main`` must stop before it imports the command's module."""
    from flashdora.tools import cli

    def refuse(args):
        raise AssertionError(f"main ran {args._module} before rejecting the options")

    monkeypatch.setattr(cli, "_run", refuse)
