"""``flashdora.native.build``: switched off it never builds; a failed build warns once and is not tried again; a
build is synchronous, says what it builds, where and how long it took; ``load(build=False)`` only loads a finished
build; ``flashdora build`` builds ahead."""

import pytest

from flashdora import native
from flashdora.native import build


@pytest.fixture
def fake_cpp(monkeypatch, tmp_path):
    """torch's ``cpp_extension.load`` replaced by a recorder that "builds" the shared library into the given
    folder; the extension cache is ``tmp_path``."""
    import torch.utils.cpp_extension as cpp

    calls = []

    def load(**kwargs):
        calls.append(kwargs)
        (tmp_path / build.name() / f"{build.name()}.so").write_text("")
        return object()

    monkeypatch.setattr(cpp, "load", load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    native.reset()
    yield calls
    native.reset()


def test_switched_off_never_builds_and_a_failed_build_warns_once(monkeypatch, fake_cpp):
    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("FLASHDORA_NATIVE", "0")
    assert not native.enabled() and native.load() is None and fake_cpp == []  # off: never tries
    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    calls = []

    def broken(**kwargs):
        calls.append(kwargs["name"])
        raise RuntimeError("no compiler\nError building extension 'x'")

    monkeypatch.setattr(cpp, "load", broken)
    monkeypatch.setattr("flashdora.backend._warned", set())
    with pytest.warns(UserWarning, match="could not be built .*Error building extension.*pip install ninja"):
        assert native.load() is None
    assert native.load() is None and native.failed() and len(calls) == 1  # tried once per process


def test_a_build_is_synchronous_and_says_what_where_and_how_long(fake_cpp, tmp_path, capsys):
    assert not native.built()
    mod = native.load()
    assert mod is not None and native.loaded() is mod and len(fake_cpp) == 1
    assert fake_cpp[0]["build_directory"] == str(tmp_path / native.name())
    err = capsys.readouterr().err
    assert f"building its C++ extension {native.name()} into {tmp_path / native.name()}" in err
    assert "once per machine" in err and f"built {native.name()} in" in err
    assert native.load() is mod and len(fake_cpp) == 1  # once per process


def test_inference_loads_only_a_finished_build(fake_cpp, capsys):
    assert native.load(build=False) is None and fake_cpp == []  # not in the cache: no build
    assert native.load(build=False) is None and fake_cpp == []  # (and no second look at the disk)
    assert native.load(build=True) is not None and len(fake_cpp) == 1  # a training call builds it
    native.reset()
    capsys.readouterr()
    assert native.load(build=False) is not None and len(fake_cpp) == 2  # in the cache now: loaded
    assert "building" not in capsys.readouterr().err  # (a load says nothing)


def test_the_name_tells_torch_python_and_source_apart():
    import sys

    import torch

    name = native.name()
    assert name.startswith("flashdora_native_") and f"py{sys.version_info.major}{sys.version_info.minor}" in name
    assert torch.__version__.split("+")[0].replace(".", "_") in name


def test_cli_build_builds_ahead(fake_cpp, capsys):
    from flashdora.tools.cli import main

    assert main(["build"]) == 0
    out = capsys.readouterr()
    assert len(fake_cpp) == 1 and native.name() in out.out


def test_a_stopped_builds_lock_is_removed_and_a_live_one_waited_for(fake_cpp, tmp_path, capsys, monkeypatch):
    """A build stopped midway leaves torch's lock behind, on which torch would wait forever: an old one is removed
    (with a line saying so) before building; a recent one (another process's build) is named, with what to do if no
    such build runs, and waited for until it goes (the build then runs: here it finds no lock), saying every
    ``LOCK_SAY_S`` that it still waits; one that grows old during the wait is removed then."""
    import os
    import threading
    import time

    monkeypatch.setattr(build, "LOCK_POLL_S", 0.02)
    monkeypatch.setattr(build, "LOCK_SAY_S", 0.1)
    folder = tmp_path / native.name()
    folder.mkdir()
    lock = folder / "lock"
    lock.write_text("")
    old = time.time() - build.LOCK_STALE_S - 60
    os.utime(lock, (old, old))
    assert native.load() is not None and not lock.exists() and len(fake_cpp) == 1
    assert f"removing {lock}, left 11 min ago by a build that was stopped" in capsys.readouterr().err

    def rebuild():  # forget the first build; the fake build records whether it found the lock
        native.reset()
        (folder / f"{native.name()}.so").unlink(missing_ok=True)

    seen = []
    monkeypatch.setattr(build, "_compile", lambda path: seen.append((path / "lock").exists()) or object())
    rebuild()
    lock.write_text("")  # fresh: another process is building, and ends in 0.35 s
    threading.Timer(0.35, lock.unlink).start()
    t0 = time.monotonic()
    assert native.load() is not None and seen == [False] and time.monotonic() - t0 >= 0.3
    err = capsys.readouterr().err
    assert f"waiting for another process's build of {native.name()} ({lock}; if none runs" in err
    assert "or the wait ends when it is 10 min old" in err and f"still waiting for {lock}" in err
    assert "removing" not in err

    rebuild()
    monkeypatch.setattr(build, "LOCK_STALE_S", 0.2)
    lock.write_text("")  # fresh, and nobody removes it: a stopped build's, found young
    assert native.load() is not None and seen == [False, False] and not lock.exists()
    err = capsys.readouterr().err
    assert "waiting for another process's build" in err and "by a build that was stopped" in err


def test_two_copies_of_the_source_get_two_builds(monkeypatch, tmp_path):
    """The name digests the source folder too: a checkout and an installed copy of the same source never share a
    build (ninja would rebuild it for each in turn, silently, the source paths being part of its commands)."""
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    first = build.name()
    monkeypatch.setattr(build, "CSRC", copy)
    monkeypatch.setattr(build, "_SOURCES", [copy / p.name for p in build._SOURCES])
    monkeypatch.setattr(build, "_HEADERS", [copy / p.name for p in build._HEADERS])
    build.name.cache_clear()
    try:
        second = build.name()
        assert second != first and second.rsplit("_", 1)[0] == first.rsplit("_", 1)[0]
    finally:
        build.name.cache_clear()
