"""The C++ extension (``native/csrc/``): built once per machine, torch version, Python and flashdora source, into
torch's extension cache, and loaded once per process.

``load(build=True)`` (the first CUDA call that trains, ``flashdora build``) builds it synchronously where the cache
lacks it, printing what it builds, where, and how long it took; later processes load it in about a second.
``load(build=False)`` (inference) loads it only where it is already built. A build that fails, or no compiler, warns
once and leaves the Triton route for the rest of the process. docs/design.md, "The C++ extension", says why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import time
from pathlib import Path

import torch

from flashdora import backend, config

CSRC = Path(__file__).parent / "csrc"
_SOURCES = [CSRC / "compose.cpp", CSRC / "layer.cpp", CSRC / "norm.cpp", CSRC / "check.cpp"]
_HEADERS = [CSRC / "launch.h", CSRC / "compose.h"]
_module = None  # the loaded extension
_state = "idle"  # idle -> loaded | failed; "unbuilt": not in the cache, and nothing asked for a build yet
seconds: float | None = None  # how long this process's build took (None: loaded from the cache, or no build)


def enabled() -> bool:
    """``config.native_on``: ``FLASHDORA_NATIVE`` / ``configure(native=...)`` (default on) with private internals
    allowed (``config.private``: the extension packs Triton's kernel arguments itself)."""
    return config.native_on


def loaded():
    """The loaded extension, or ``None``; never builds or loads."""
    return _module


def failed() -> bool:
    """Whether a build was tried in this process and failed (the Triton route serves for the rest of it)."""
    return _state == "failed"


@functools.cache
def name() -> str:
    """The extension's name: torch's version, Python's and a digest of the C++ source and of the folder it is in
    (a cached build of other source, which ninja's timestamps alone might keep, is never loaded; two copies of
    flashdora, say a checkout and an installed wheel, each get their own build instead of rebuilding one another's
    in turn, which ninja does without a word whenever the source paths differ)."""
    h = hashlib.sha256(str(CSRC.resolve()).encode())
    for p in (*_SOURCES, *_HEADERS):
        h.update(p.read_bytes())
    digest = h.hexdigest()[:10]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"flashdora_native_{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}_{py}_{digest}"


def directory() -> Path:
    """Where it is built and cached: ``$TORCH_EXTENSIONS_DIR`` (else torch's default root), then ``name()``."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name()


def built() -> bool:
    """Whether the cache holds a finished build of this source (its shared library)."""
    return (directory() / f"{name()}.so").exists()


def load(build: bool = True):
    """The extension, loaded on the first call of the process; ``None`` where it is switched off, failed, or (with
    ``build=False``) not built yet. ``build``: build it where the cache lacks it (synchronously: the caller waits)."""
    global _module, _state, seconds
    if _module is not None or _state == "failed" or not enabled() or (_state == "unbuilt" and not build):
        return _module
    fresh = not built()
    if fresh and not build:
        _state = "unbuilt"
        return None
    path = directory()
    if fresh:
        _say(
            f"building its C++ extension {name()} into {path} (once per machine, torch version and flashdora source; "
            "`flashdora build` does it ahead; FLASHDORA_NATIVE=0 skips it) ..."
        )
        _wait_for_lock(path)
    t0 = time.perf_counter()
    _module = _compile(path)
    _state = "loaded" if _module is not None else "failed"
    if fresh and _module is not None:
        seconds = time.perf_counter() - t0
        _say(f"built {name()} in {seconds:.1f} s")
    return _module


def _say(message: str) -> None:
    """A line on stderr, at once: what a build does while the caller waits."""
    print(f"flashdora: {message}", file=sys.stderr, flush=True)


LOCK_STALE_S = 600  # a build's lock older than this (a build takes a minute or two) is one a stopped build left
LOCK_POLL_S = 1.0  # how often a wait for another process's build looks at its lock
LOCK_SAY_S = 60  # how often that wait says it still waits


def _wait_for_lock(path: Path) -> None:
    """Wait while torch's build lock (``path / "lock"``, ``cpp_extension``'s ``FileBaton``) says another process
    builds, then return. A lock outlives a build stopped midway (an interrupt, a killed job), and torch waits on it
    forever: one older than ``LOCK_STALE_S`` (at once, or once it gets that old during the wait) is removed, saying
    so. The wait says what it waits for, how to end it, and every ``LOCK_SAY_S`` that it still waits."""
    lock = path / "lock"
    said = None
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:
            return  # no lock (or the other build finished)
        if age > LOCK_STALE_S:
            _say(f"removing {lock}, left {age / 60:.0f} min ago by a build that was stopped")
            lock.unlink(missing_ok=True)
            return
        now = time.monotonic()
        if said is None:
            _say(
                f"waiting for another process's build of {name()} ({lock}; if none runs, one was stopped midway: "
                f"delete that file, or the wait ends when it is {LOCK_STALE_S // 60} min old)"
            )
            said = now
        elif now - said >= LOCK_SAY_S:
            _say(f"still waiting for {lock} ({age:.0f} s old)")
            said = now
        time.sleep(LOCK_POLL_S)


def _compile(path: Path):
    from torch.utils.cpp_extension import load as cpp_load

    path.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_load(
            name=name(), sources=[str(p) for p in _SOURCES], extra_cflags=["-O2"], build_directory=str(path),
            verbose=False,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: the Triton route still works
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        backend.warn_once(
            "native",
            f"flashdora: the C++ extension could not be built ({msg}); the Triton route runs for the rest of this "
            "process (same results, more host time a layer). It needs a C++ compiler and ninja (pip install "
            "ninja); FLASHDORA_NATIVE=0 silences this",
        )
        return None


def reset() -> None:
    """Forget the loaded extension (tests): the next ``load`` loads it again."""
    global _module, _state
    _module, _state = None, "idle"
