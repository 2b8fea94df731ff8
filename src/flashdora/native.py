"""The compose on the Triton path in C++ (``csrc/compose.cpp``): its forward and its backward node, built once per
machine.

A layer of ordinary size is bound by the host. The C++ forward runs the LoRA A matmul and launches the fused forward
kernel the Python path compiled and tuned (its launch plan comes from ``kernels.compose.fwd_plan``), and in training
hangs the backward node on the output. The Python path's backward is otherwise an ``autograd.Function``: inside a
model's backward it runs on the autograd engine's device thread, between the C++ nodes of everything else, and there
its Python cost per layer is several times what the same code costs in a loop. The node does
the same work in C++: it launches the compose-backward kernel (plan from ``kernels.compose.bwd_plan``), then the
magnitude gradient's second stage and the two LoRA GEMMs. A norm cache miss (once per layer and optimizer step in
training) runs in C++ too (``norm_scales``: the launches of ``kernels.norm.norm_and_scales``). A call the C++ side
has no plan for yet (a shape's first calls, which tune and compile) runs the Python path, which then files the plans.
The extension also holds a mixed-adapter layer's kept-stack check (``csrc/check.cpp``, ``peft.mixed``).

It is built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja, as Triton's own launcher needs a compiler;
no CUDA toolkit: it finds ``cuLaunchKernel`` in the driver torch loaded) into torch's extension cache, once per
machine, torch version and version of its source (tens of seconds; later processes load it in a second). The first
Triton-path call of a CUDA layer starts the build (or load) in a background thread and the Python path runs until it
is ready, so a fresh machine's first steps do not wait for a compiler (the two paths give the same bits). It is on by
default (``FLASHDORA_NATIVE=0`` keeps the Python path and never builds): it cuts the host time of a layer call
(docs/benchmarks.md has the whole-model A/B). A build that fails warns once (with the fix) and leaves the Python path.
"""

from __future__ import annotations

import atexit
import hashlib
import re
import sys
import threading
from pathlib import Path

import torch

from flashdora import backend, config

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "compose.cpp", _CSRC / "norm.cpp", _CSRC / "check.cpp"]  # (and launch.h: compose.cpp, norm.cpp)
_module = None  # the built extension, once loaded
_adopted = None  # the extension the layer path uses: ``_module`` from a point where no forward awaits its backward
_state = "idle"  # idle -> building -> ready | failed
_thread: threading.Thread | None = None
_lock = threading.Lock()
_done = threading.Event()  # set when a build has ended


def enabled() -> bool:
    """``config.native_on``: ``FLASHDORA_NATIVE`` / ``configure(native=...)`` (default on; off keeps the Python path
    and never builds the extension), and private internals allowed (``config.private``: it packs Triton's kernel
    arguments itself)."""
    return config.native_on


def module(wait: bool = True):
    """The extension the layer path uses, or ``None``: switched off, the build failed, or (``wait=False``) still
    building or built but not adopted yet. The first call while switched on starts the build or load in a background
    thread; ``wait=True`` (benchmarks, tests, the demo) blocks until it has ended and adopts it at once.

    A build that ends mid-step is not used until ``adopt`` runs at a quiet point: a checkpointed forward and its
    recomputation must take the same route (the C++ path and bitsandbytes' shortcut it enables save other tensors
    than the layer's own calls). Quiet points: an optimizer step outside a backward (``torch.optim``'s step post hook),
    a layer call without grad while no forward with grad awaits its backward (inference; reentrant checkpointing's
    first forward, which saves nothing), and ``module(wait=True)``.
    """
    global _state, _thread
    if _state == "idle" and enabled():
        with _lock:
            if _state == "idle":
                _done.clear()
                _state = "building"  # (before the thread starts: it sets the final state)
                # A process that ends while the build runs waits for it at exit (atexit, up to EXIT_WAIT_S): killed
                # mid-build, torch's build would leave its lock file behind, and every later build on the machine
                # would wait on that lock for ever. The bound keeps a build stuck on someone else's stale lock from
                # holding the process for ever in turn.
                _watch_steps()
                _thread = threading.Thread(target=_build, name="flashdora-native-build", daemon=True)
                _thread.start()
                atexit.register(_wait_at_exit, _thread)
    if wait:
        if _state == "building":
            _done.wait()
        adopt()
    return _adopted


_at_quiet: list = []  # launch-plan filings waiting for the next quiet point (``when_quiet``)
_busy = False  # a compose ran with grad since the last optimizer step: its backward (or recomputation) may be ahead


def when_quiet(fn) -> None:
    """Run ``fn`` at the next quiet point (``adopt``). A backward kernel's plan decides which node a call hangs (the
    C++ node, or the Python path's), and that kernel compiles in the middle of a step, in the first backward of a
    shape: a forward before it and its checkpoint recomputation after it must still hang the same node."""
    _at_quiet.append(fn)


def adopt() -> None:
    """Start using a built extension, and file the plans that waited (a quiet point: no forward of the process
    awaits its backward)."""
    global _adopted
    if _adopted is None and _module is not None and enabled():
        _adopted = _module
    while _at_quiet:
        _at_quiet.pop(0)()


def adopt_without_grad() -> None:
    """``adopt`` from a layer call without grad (it records nothing for a backward), unless a forward with grad ran
    since the last optimizer step: its backward, and its checkpoint recomputation, may still come (an evaluation or
    a reference model's forward in the middle of a training step)."""
    if not _busy and not torch.is_grad_enabled() and (_at_quiet or (_adopted is None and _module is not None)):
        adopt()


def _after_step(optimizer, args, kwargs) -> None:
    """A ``torch.optim`` step outside any backward: every forward before it has had its backward (a step taken inside
    a backward, an optimizer step in the backward, is no quiet point: a recomputation may follow)."""
    global _busy
    if _graph_task() != -1:
        return
    _busy = False
    adopt()


def _graph_task() -> int:
    """The running backward's id (-1: none). Private (``torch._C``): without it, every step counts as in one."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task() if task is not None and config.private else 0


_step_hook = None


def _watch_steps() -> None:
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook = register_optimizer_step_post_hook(_after_step)


EXIT_WAIT_S = 600.0


def _wait_at_exit(thread: threading.Thread) -> None:
    thread.join(EXIT_WAIT_S)
    if thread.is_alive():
        print(
            f"flashdora: the C++ compose's build is still running after {EXIT_WAIT_S:g} s; exiting without it. If "
            "torch's extension build waits on a lock left by a killed process, delete that lock file in "
            "TORCH_EXTENSIONS_DIR (torch's extension cache)",
            file=sys.stderr,
        )


def failed() -> bool:
    """Whether the build was tried and failed (the Python path stays for the rest of the process)."""
    return _state == "failed"


def _build() -> None:
    global _module, _state
    try:
        _module = _load()
    finally:
        _state = "ready" if _module is not None else "failed"
        _done.set()


def _load():
    from torch.utils.cpp_extension import load

    # A build is tied to its torch's ABI and to its source: the hash keeps a cached build of other source (an older
    # flashdora, whose installed file may be older than that build, which ninja's timestamps alone would keep) apart.
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*_SOURCES, _CSRC / "launch.h"))).hexdigest()[:10]
    name = f"flashdora_native_{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}_{digest}"
    print(
        f"flashdora: loading its C++ compose ({name}; built once per machine, torch version and flashdora source, "
        "in the background: the Python path runs until it is ready; FLASHDORA_NATIVE=0 skips it)",
        file=sys.stderr,
    )
    try:
        return load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=["-O2"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: the Python path still works
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        backend.warn_once(
            "native",
            f"flashdora: the C++ compose could not be built ({msg}); the Python path runs instead (same "
            "results, more host time a layer). It needs a C++ compiler and ninja (pip install ninja); "
            "FLASHDORA_NATIVE=0 silences this",
        )


def reset() -> None:
    """Forget the build (tests): the next ``module()`` loads or builds it again."""
    global _module, _adopted, _state, _thread
    if _thread is not None:
        _thread.join()
    _module, _adopted, _state, _thread = None, None, "idle", None
