"""Every switch and version gate, in one place, read once.

Settings come from ``FLASHDORA_*`` environment variables when this module is first imported (at the first use of a
public name such as ``flashdora.enable``; a bad value raises there: docs/usage.md), and change at run time only
through ``flashdora.configure(...)`` (or ``reload()``, which reads the environment again). The layer path reads
them as module attributes (``config.backend``, ``config.native``...): no environment lookup per call.

| setting | variable | default | what it does |
|---|---|---|---|
| ``backend`` | ``FLASHDORA_BACKEND`` | ``auto`` | ``auto`` (Triton on CUDA, else eager), ``triton``, ``eager`` |
| ``native`` | ``FLASHDORA_NATIVE`` | on | the C++ compose, norm and 4-bit dequantization (built as training starts) |
| ``norm_cache`` | ``FLASHDORA_NORM_CACHE`` | on | the norm once per weight version |
| ``private_apis`` | ``FLASHDORA_PRIVATE_APIS`` | on | private torch/Triton/bitsandbytes internals (``private``) |
| ``static_launch`` | ``FLASHDORA_STATIC_LAUNCH`` | on | torch's C++ launcher of Triton kernels |
| ``autotune`` | ``FLASHDORA_AUTOTUNE`` | off | time every kernel config at a new shape |
| ``double_backward`` | ``FLASHDORA_DOUBLE_BACKWARD`` | off | forwards a second backward can go through |

Version gates (``TESTED``): private internals of a library are used only on the versions the tests cover; on any
other version, or with ``private_apis`` off, the plain public path runs (``private``). PEFT's private surface
(``LoraLayer._cast_input_dtype``, ``_active_adapter``, ``_disable_adapters``, the ``lora.bnb`` classes' forwards,
``DoraLinearVariant.forward``) is gated by ``peft_tested``: outside the tested range ``enable`` still works, but
layers run PEFT's own forward (``peft_fallback:peft-version``). DeepSpeed's (the names of ZeRO-3's module hooks) is
gated by ``deepspeed_tested``: elsewhere ZeRO-3 layers run PEFT's forward (``peft_fallback:deepspeed_zero3``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re

import torch

BACKENDS = ("auto", "triton", "eager")
_SWITCHES = {  # setting: (environment variable, default)
    "native": ("FLASHDORA_NATIVE", True),
    "norm_cache": ("FLASHDORA_NORM_CACHE", True),
    "private_apis": ("FLASHDORA_PRIVATE_APIS", True),
    "static_launch": ("FLASHDORA_STATIC_LAUNCH", True),
    "autotune": ("FLASHDORA_AUTOTUNE", False),
    "double_backward": ("FLASHDORA_DOUBLE_BACKWARD", False),
}
NAMES = ("backend", *_SWITCHES)

# The library versions the tests cover, as (lowest, highest) (major, minor) inclusive.
TESTED = {
    "torch": ((2, 11), (2, 13)),
    "triton": ((3, 6), (3, 9)),
    "bitsandbytes": ((0, 50), (0, 50)),
    "peft": ((0, 19), (0, 21)),
    "deepspeed": ((0, 19), (0, 19)),
}

# The settings (module attributes, set by ``_apply``), and what follows from them and the versions:
backend = "auto"
native = norm_cache = private_apis = static_launch = True
autotune = double_backward = False
private = True  # private internals allowed: tested torch and Triton, and ``private_apis`` on
native_on = True  # the C++ extension may be built and used: ``native`` and ``private``


def _minor(version: str) -> tuple[int, int]:
    parts = re.findall(r"\d+", version)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


@functools.cache
def installed(name: str) -> str | None:
    """The installed version of ``name`` (``None``: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    if name == "torch":
        return torch.__version__
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def tested(name: str) -> bool:
    """Whether the installed ``name`` is a version the tests cover (``TESTED``)."""
    found = installed(name)
    if found is None:
        return False
    lo, hi = TESTED[name]
    return lo <= _minor(found) <= hi


@functools.cache
def tested_versions() -> bool:
    """Whether this torch and Triton are versions the tests cover."""
    return tested("torch") and tested("triton")


_PEFT_TESTED: list[bool] = []  # (a list, not functools.cache: torch.compile traces through a cache's wrapper)


def peft_tested() -> bool:
    """Whether the installed PEFT is a version the tests cover; asked on every layer call, inside ``torch.compile``
    too, so it is worked out once, at the first call outside a compiled region (importlib.metadata reads files)."""
    if not _PEFT_TESTED:
        if torch.compiler.is_compiling():
            return _peft_tested_now()
        _PEFT_TESTED.append(tested("peft"))
    return _PEFT_TESTED[0]


def bnb_tested() -> bool:
    """Whether the installed bitsandbytes is a version flashdora's uses of its internals were tested with
    (``TESTED``: the exported kernels the C++ path calls, the private names ``quant.base`` reads)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    lo, hi = TESTED["bitsandbytes"]
    return lo <= _minor(str(bnb.__version__)) <= hi


_DEEPSPEED_TESTED: list[bool] = []


def deepspeed_tested() -> bool:
    """Whether DeepSpeed's private surface may be used: a version the tests cover (``TESTED``) and ``private_apis``
    on. flashdora tells DeepSpeed ZeRO-3's module hooks on the adapter modules by their closures' names; elsewhere
    ZeRO-3 layers run PEFT's forward (``peft_fallback:deepspeed_zero3``). Asked outside compiled regions only."""
    if not _DEEPSPEED_TESTED:
        _DEEPSPEED_TESTED.append(tested("deepspeed"))
    return _DEEPSPEED_TESTED[0] and private_apis


@torch.compiler.assume_constant_result
def _peft_tested_now() -> bool:
    return tested("peft")


def _switch(name: str, raw) -> bool:
    value = ("" if raw is None else str(raw)).strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    var, default = _SWITCHES[name]
    if value == "":
        return default
    raise ValueError(f"{var} expected one of 1, true, on, yes, 0, false, off, no (or unset), got {raw!r}")


def _backend(raw, what: str = "FLASHDORA_BACKEND") -> str:
    value = ("" if raw is None else str(raw)).strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{what} expected one of {', '.join(BACKENDS)}, got {raw!r}")
    return value


def _from_env() -> dict:
    out = {"backend": _backend(os.environ.get("FLASHDORA_BACKEND"))}
    for name, (var, _) in _SWITCHES.items():
        out[name] = _switch(name, os.environ.get(var))
    return out


def _apply(values: dict) -> None:
    global private, native_on
    globals().update(values)
    private = private_apis and tested_versions()
    native_on = native and private


def current() -> dict:
    """The settings now: ``{name: value}``."""
    return {name: globals()[name] for name in NAMES}


def reload() -> dict:
    """Read the ``FLASHDORA_*`` environment variables again (a ``ValueError`` names a variable with a bad value);
    returns the settings."""
    _apply(_from_env())
    return current()


def configure(**settings) -> dict:
    """Change flashdora's settings for this process; returns the settings as they were before.

    ``backend``: ``"auto"``, ``"triton"`` or ``"eager"``; ``native``, ``norm_cache``, ``private_apis``,
    ``static_launch``, ``autotune``, ``double_backward`` (``flashdora.double_backward``): ``True`` or ``False``.
    Unnamed settings keep their values. The environment
    variables of the same names (``FLASHDORA_BACKEND``...) give the values at import. Example:
    ``flashdora.configure(native=False)`` keeps every layer on the Python path from the next call on.
    """
    before = current()
    values = dict(before)
    for name, value in settings.items():
        if name not in NAMES:
            raise TypeError(f"configure: unknown setting {name!r}; expected one of {', '.join(NAMES)}")
        allowed = BACKENDS if name == "backend" else (True, False)
        # (exactly the documented values: no other spelling of a backend, no 0/1 or numpy bool for a switch)
        if not any(value is a or (type(value) is str and value == a) for a in allowed):
            raise ValueError(f"configure: {name} expected one of {', '.join(map(str, allowed))}, got {value!r}")
        values[name] = value
    _apply(values)
    return before


@contextlib.contextmanager
def override(**settings):
    """``configure(**settings)`` inside a ``with`` block, restored after it."""
    before = configure(**settings)
    try:
        yield
    finally:
        _apply(before)


reload()
