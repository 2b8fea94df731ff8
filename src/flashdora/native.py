"""The compose's backward as a C++ autograd node (``csrc/compose_backward.cpp``), built once per machine.

On the Triton path the compose's backward is otherwise a Python ``autograd.Function``. Inside a model's backward it
runs on the autograd engine's device thread, between the C++ nodes of everything else, and there its Python cost
per layer is several times what the same code costs in a loop (docs/benchmarks.md, thirteenth session). The node does
the same work in C++: it launches the compose-backward kernel the Python path compiled and tuned (its launch plan
comes from ``kernels.compose.bwd_plan``), then the magnitude gradient's second stage and the two LoRA GEMMs.

It is built with ``torch.utils.cpp_extension`` (a C++ compiler, as Triton's own launcher needs one; no CUDA toolkit:
the node finds ``cuLaunchKernel`` in the driver torch loaded) on the first training forward of a CUDA layer, into
torch's extension cache, once per machine and torch version. It is opt-in (``FLASHDORA_NATIVE=1``): it gives the
Python path's bits, but a model's accumulation step showed no gain beyond the device machines' noise yet
(docs/benchmarks.md, thirteenth session). A build that fails warns once and leaves the Python backward.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from flashdora import backend

_SOURCE = Path(__file__).parent / "csrc" / "compose_backward.cpp"
_module = None
_tried = False


def enabled() -> bool:
    """``FLASHDORA_NATIVE`` (default off, docs/decisions.md): ``1``, ``true``, ``on`` or ``yes`` builds and takes the
    node. Set it before the first training forward: a process that ran one without it keeps the Python backward."""
    raw = backend.env_raw("FLASHDORA_NATIVE")
    return raw is not None and backend.env_str(raw).strip().lower() in ("1", "true", "on", "yes")


def module():
    """The built extension, or ``None`` (switched off, or the build failed). The first call builds it."""
    if not _tried:
        _build()
    return _module


def _build() -> None:
    global _module, _tried
    _tried = True
    if not enabled():
        return
    from torch.utils.cpp_extension import load

    name = "flashdora_native_" + re.sub(r"\W", "_", torch.__version__)  # (a build is tied to its torch's ABI)
    print(f"flashdora: loading its C++ backward node ({name}; built once per machine)", file=sys.stderr)
    try:
        _module = load(name=name, sources=[str(_SOURCE)], extra_cflags=["-O2"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: the Python backward still works
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        backend.warn_once("native", f"flashdora: the C++ backward node could not be built ({msg}); Python runs it")


def reset() -> None:
    """Forget the build (tests): the next ``module()`` loads or builds it again."""
    global _module, _tried
    _module, _tried = None, False
