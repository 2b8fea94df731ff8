"""Backend choice (``config.backend``: auto|triton|eager) and the per-path call counters behind ``stats()``."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import Counter

import torch

from flashdora import config

BACKENDS = config.BACKENDS

_counts: Counter[str] = Counter()
_warned: set[str] = set()


def requested_backend() -> str:
    """The backend asked for (``config.backend``: ``FLASHDORA_BACKEND`` at import, or ``flashdora.configure``)."""
    return config.backend


_HAS_TRITON: bool | None = None


def triton_available() -> bool:
    """True when ``flashdora.kernels`` can launch Triton kernels (a GPU, or the CPU interpreter)."""
    global _HAS_TRITON
    if _HAS_TRITON is None:
        from flashdora import kernels

        _HAS_TRITON = kernels.HAS_TRITON
    return _HAS_TRITON


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether an op on ``tensors`` takes the Triton path.

    ``auto``: Triton for CUDA tensors when Triton imports, eager otherwise (and for float64 tensors, which the
    float32 kernels would not keep exact). ``triton``: Triton whenever it can run (CUDA tensors, or CPU tensors
    under ``TRITON_INTERPRET=1``); asking for it where it cannot run is an error, never a silent switch.
    ``eager``: never. CUDA tensors on a device other than the current one (layers spread over GPUs in one process,
    e.g. ``device_map="auto"``) run eager under ``auto``, with a one-time warning, and are an error under
    ``triton``: the kernels launch on the current device. Called several times per layer call, so the common case
    is a few attribute reads.
    """
    backend = config.backend
    if backend == "eager":
        return False
    if backend == "auto":
        for t in tensors:
            if not t.is_cuda or t.dtype == torch.float64:
                return False
        if tensors[0].get_device() != current_cuda_device():
            warn_once("other_device", _other_device_message(tensors[0]) + "; these calls run flashdora's eager path")
            return False
        return triton_available()
    if any(t.dtype == torch.float64 for t in tensors):  # the kernels compute in float32: references stay exact
        raise RuntimeError("FLASHDORA_BACKEND=triton: the Triton kernels compute in float32; float64 runs eager")
    if not triton_available():
        raise RuntimeError("FLASHDORA_BACKEND=triton, but triton is not importable; install triton or use eager")
    on_cuda = all(t.is_cuda for t in tensors)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and all(t.device.type == "cpu" for t in tensors)
    if not (on_cuda or interpreted):
        devices = sorted({str(t.device) for t in tensors})
        raise RuntimeError(
            f"FLASHDORA_BACKEND=triton needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got devices {devices}"
        )
    if on_cuda and tensors[0].get_device() != current_cuda_device():
        raise RuntimeError(f"FLASHDORA_BACKEND=triton: {_other_device_message(tensors[0])}")
    return True


_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)  # private: gated by config.private


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jvp, jacrev, ...) is running: torch's private test where
    private internals are allowed (``config.private``), else the public one, ``torch._C._functorch`` levels being
    private too: ``torch.func`` transforms then reach flashdora's code, which runs PEFT's forward for them where
    it can tell (``dispatch``) and raises in the autograd Function where it cannot."""
    return config.private and _FUNCTORCH_ACTIVE is not None and _FUNCTORCH_ACTIVE()


def tested_versions() -> bool:
    """Whether this torch and Triton are versions the tests cover (``config.TESTED``)."""
    return config.tested_versions()


def private_apis() -> bool:
    """Whether the fast launch path and the C++ compose may use torch's and Triton's private internals
    (``config.private``: tested versions, and ``FLASHDORA_PRIVATE_APIS`` / ``configure(private_apis=...)`` on)."""
    return config.private


_CUDA_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)  # (absent from CPU builds)


def current_cuda_device() -> int:
    """The index of the current CUDA device (``torch.cuda.current_device()`` without its Python layers)."""
    return _CUDA_GET_DEVICE() if _CUDA_GET_DEVICE is not None else torch.cuda.current_device()


def _other_device_message(t: torch.Tensor) -> str:
    index = t.get_device()
    return (
        f"tensors on cuda:{index} while cuda:{current_cuda_device()} is the current device (the Triton kernels "
        f"launch on the current device; torch.cuda.set_device({index}) before the call gives them the kernels)"
    )


def autocast_off(device_type: str):
    """A context with autocast off on ``device_type`` for math whose dtypes are explicit; a no-op context where it is
    off already (entering ``torch.autocast`` costs more than a small torch op)."""
    if device_type != "meta" and torch.is_autocast_enabled(device_type):  # (meta tensors: no autocast to ask)
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def count(path: str, n: int = 1) -> None:
    """Add ``n`` calls to the counter of ``path`` (e.g. ``eager``, ``triton``, ``peft_fallback:conv``)."""
    _counts[path] += n


def warn_once(key: str, message: str) -> None:
    """Warn with ``message`` the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def stats() -> dict[str, int]:
    """A copy of the call counters: ``{path: calls}``."""
    return dict(_counts)


def reset_stats() -> None:
    """Zero every counter (the one-time warnings stay given)."""
    _counts.clear()
