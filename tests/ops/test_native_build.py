"""``flashdora.native``'s build: switched off it never builds, a failed build warns once, the build runs in the
background while the Python path serves, and a process that ends mid-build waits for it (boundedly) at exit."""

import os

import pytest

from flashdora import dispatch, native


def test_switched_off_never_builds_and_a_failed_build_warns(monkeypatch):
    import torch.utils.cpp_extension as cpp

    calls = []

    def broken(**kwargs):
        calls.append(kwargs["name"])
        raise RuntimeError("no compiler\nError building extension 'x'")

    monkeypatch.setattr(cpp, "load", broken)
    monkeypatch.setenv("FLASHDORA_NATIVE", "0")
    native.reset()
    assert not native.enabled() and native.module() is None and calls == []  # off: never tries to build
    monkeypatch.delenv("FLASHDORA_NATIVE")  # default: on
    native.reset()
    assert native.enabled()
    monkeypatch.setattr("flashdora.backend._warned", set())
    with pytest.warns(UserWarning, match="could not be built .*Error building extension.*pip install ninja"):
        assert native.module() is None
    assert native.module() is None and len(calls) == 1  # tried once per process
    native.reset()


def test_build_runs_in_the_background(monkeypatch):
    """A fresh machine's first steps do not wait for the compiler: while the build runs, ``module(wait=False)`` gives
    ``None`` and the compose asks again at its next call; once built, the extension is taken."""
    import threading

    import torch.utils.cpp_extension as cpp

    release, built = threading.Event(), object()

    def slow(**kwargs):
        assert release.wait(30)
        return built

    monkeypatch.setattr(cpp, "load", slow)
    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    native.reset()
    assert native.module(wait=False) is None and not native.failed()
    assert not dispatch.native_ready()  # this call: the Python path; the next asks again
    release.set()
    assert native.module() is built
    assert dispatch.native_ready() and native._adopted is built
    native.reset()


def test_a_process_that_ends_mid_build_waits_for_it(tmp_path):
    """torch's build holds a lock file while it runs: a process killed mid-build would leave it behind, and every
    later build on the machine would wait on it for ever. The build thread is no daemon, so a process whose work
    ends first still lets the build finish (and release its lock) before it exits."""
    import subprocess
    import sys

    done = tmp_path / "built"
    code = f"""
import time
import torch.utils.cpp_extension as cpp
from flashdora import native

def slow(**kwargs):
    time.sleep(1.0)
    open({str(done)!r}, "w").close()
    return object()

cpp.load = slow
assert native.module(wait=False) is None  # building; the process's work ends here
"""
    env = {**os.environ, "FLASHDORA_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert done.exists()


def test_the_exit_wait_is_bounded():
    """A build stuck (on another process's stale lock, say) does not hold the process for ever: after
    ``EXIT_WAIT_S`` it exits with a message that says what to delete."""
    import subprocess
    import sys
    import time

    code = """
import time
import torch.utils.cpp_extension as cpp
from flashdora import native

def stuck(**kwargs):
    time.sleep(60)

cpp.load = stuck
native.EXIT_WAIT_S = 0.5
assert native.module(wait=False) is None
"""
    env = {**os.environ, "FLASHDORA_NATIVE": "1"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert time.monotonic() - t0 < 40
    assert "still running after 0.5 s" in out.stderr and "TORCH_EXTENSIONS_DIR" in out.stderr
