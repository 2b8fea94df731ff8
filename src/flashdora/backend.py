"""Backend choice (``FLASHDORA_BACKEND=auto|triton|eager``) and the per-path call counters behind ``stats()``."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import warnings
from collections import Counter

import torch

BACKENDS = ("auto", "triton", "eager")

_counts: Counter[str] = Counter()
_warned: set[str] = set()


_ENVIRON = os.environ
_ENV_DATA = getattr(_ENVIRON, "_data", None)  # the dict behind os.environ (CPython), read without its Python layers
_ENV_ENCODE = getattr(_ENVIRON, "encodekey", None)
_ENV_DECODE = getattr(_ENVIRON, "decodevalue", None)


def env_raw(name: str):
    """``os.environ.get(name)`` as stored (bytes on POSIX; ``None`` when unset), at a dict lookup's cost: the layer
    path reads its switches on every call, where ``os.environ.get`` costs three Python calls. The caller decodes
    with ``env_str``. A replaced ``os.environ`` (``mock.patch("os.environ", ...)``) is read through ``.get``."""
    if os.environ is not _ENVIRON or _ENV_DATA is None or _ENV_ENCODE is None:
        return os.environ.get(name)
    return _ENV_DATA.get(_env_key(name))


@functools.cache
def _env_key(name: str):
    return _ENV_ENCODE(name)


def env_str(raw) -> str:
    """An ``env_raw`` value as ``str`` (decoded as ``os.environ`` decodes it)."""
    if isinstance(raw, bytes):
        return _ENV_DECODE(raw) if _ENV_DECODE is not None else os.fsdecode(raw)
    return raw


def switch(name: str, default: bool) -> bool:
    """An on/off environment switch: ``1``, ``true``, ``on`` or ``yes`` turn it on, ``0``, ``false``, ``off`` or
    ``no`` off; unset or empty gives ``default``; anything else is a ``ValueError`` that names the variable. Cheap
    enough for the layer path (a lookup and a cache)."""
    if os.environ is _ENVIRON and _ENV_DATA is not None and _ENV_ENCODE is not None:  # env_raw, inlined
        return _switch_value(name, _ENV_DATA.get(_env_key(name)), default)
    return _switch_value(name, os.environ.get(name), default)


@functools.lru_cache(maxsize=64)
def _switch_value(name: str, raw, default: bool) -> bool:
    value = (env_str(raw) or "").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    if value == "":
        return default
    raise ValueError(f"{name} expected one of 1, true, on, yes, 0, false, off, no (or unset), got {env_str(raw)!r}")


def requested_backend() -> str:
    """The backend named by ``FLASHDORA_BACKEND`` (default ``auto``); read on every call so tests can switch it."""
    return _parse_backend(env_raw("FLASHDORA_BACKEND"))


@functools.lru_cache(maxsize=16)
def _parse_backend(raw) -> str:
    value = (env_str(raw) or "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"FLASHDORA_BACKEND expected one of {', '.join(BACKENDS)}, got {value!r}")
    return value


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
    backend = requested_backend()
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
    interpreted = env_str(env_raw("TRITON_INTERPRET")) == "1" and all(t.device.type == "cpu" for t in tensors)
    if not (on_cuda or interpreted):
        devices = sorted({str(t.device) for t in tensors})
        raise RuntimeError(
            f"FLASHDORA_BACKEND=triton needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got devices {devices}"
        )
    if on_cuda and tensors[0].get_device() != current_cuda_device():
        raise RuntimeError(f"FLASHDORA_BACKEND=triton: {_other_device_message(tensors[0])}")
    return True


_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)  # private: gated, see below


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jvp, jacrev, ...) is running. Reads a private torch function
    present in every torch version the tests cover; where it is missing, ``False`` (the transforms then reach
    flashdora's code and raise there)."""
    return _FUNCTORCH_ACTIVE is not None and _FUNCTORCH_ACTIVE()


# The torch and Triton versions the test suite covers. The fast launch path (torch's C++ launcher of Triton kernels,
# Triton's own launcher called directly) and the C++ compose rely on their private internals: on any other version
# every kernel launches through the plain ``kernel[grid]`` and the compose stays in Python.
TESTED = {"torch": ((2, 11), (2, 13)), "triton": ((3, 6), (3, 9))}


def _minor(version: str) -> tuple[int, int]:
    parts = re.findall(r"\d+", version)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


@functools.cache
def tested_versions() -> bool:
    """Whether this torch and Triton are versions the tests cover (``TESTED``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = {"torch": torch.__version__, "triton": version("triton")}
    except PackageNotFoundError:
        return False
    return all(lo <= _minor(found[name]) <= hi for name, (lo, hi) in TESTED.items())


def private_apis() -> bool:
    """Whether the fast launch path and the C++ compose may use torch's and Triton's private internals: tested
    versions (``tested_versions``) and ``FLASHDORA_PRIVATE_APIS`` not off (``0`` forces the plain path)."""
    return tested_versions() and switch("FLASHDORA_PRIVATE_APIS", True)


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
