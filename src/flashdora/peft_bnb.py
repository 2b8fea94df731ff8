"""PEFT's LoRA layers for bitsandbytes bases (``peft.tuners.lora.bnb.Linear4bit`` and ``Linear8bitLt``, what PEFT
wraps a model's quantized layers in when it was loaded quantized), as ``enable`` re-classes them:
``FlashDoraLinear4bit`` and ``FlashDoraLinear8bitLt``.

Their forward is PEFT's on every call flashdora does not run; on a plain call of one active flashdora adapter it is
PEFT's function without PEFT's per-call dispatch, and the base result comes from ``bnb_base.result`` (the same
values as the layer's own call, a fraction of its host time, and a 4-bit layer's dense weight handed to a norm-cache
miss).

The classes are made on first use (module attributes, PEP 562), so that importing flashdora never imports
bitsandbytes; a pickled class is found the same way.
"""

from __future__ import annotations

import sys

import torch

from flashdora import bnb_base
from flashdora import peft_integration as _pi  # (a cycle: read at call time)
from flashdora.layers import param as _param
from flashdora.ops.compose import after_base

_PEFT_BNB = "peft.tuners.lora.bnb"
KINDS = ("Linear4bit", "Linear8bitLt")
_CLONES = {"Linear4bit": True, "Linear8bitLt": False}  # PEFT's forward clones a 4-bit layer's output, not an 8-bit's
_peft_forwards: dict[str, object] = {}
_flash_classes: dict[str, type] = {}


def _lean_forward(self, x, *args, **kwargs):
    """``FlashDoraLinear4bit.forward`` / ``FlashDoraLinear8bitLt.forward``, and PEFT's own classes' forward while
    ``patch_peft`` is on."""
    active = self._active_adapter
    if type(active) is not str:
        active = active[0] if len(active) == 1 else None
    mods = self._modules
    a_layers = mods["lora_A"]._modules
    if (
        args or kwargs or active is None or self._disable_adapters or self.merged_adapters or active not in a_layers
        or not _pi._runs_flashdora(type(self.lora_variant.get(active)))
    ):  # fmt: skip
        return _peft_forward(self._flashdora_kind)(self, x, *args, **kwargs)
    seq = after_base()
    try:
        result, fresh = bnb_base.result(mods["base_layer"], x)
        if not fresh and _CLONES[self._flashdora_kind]:
            result = result.clone()  # PEFT's defensive copy of bitsandbytes' 4-bit output
        if torch.is_autocast_enabled():  # (PEFT's test: no conversion of x or of the result under autocast)
            return _pi.flash_forward(self, active, x, result, seq)
        dtype = result.dtype
        x = self._cast_input_dtype(x, _param(a_layers[active], "weight").dtype)
        return _pi.flash_forward(self, active, x, result, seq).to(dtype)
    finally:
        bnb_base.release()  # (the dense weight a 4-bit forward held for the miss)


def peft_class(kind: str, load: bool = False) -> type | None:
    """PEFT's ``lora.bnb.<kind>`` where PEFT has loaded it (a model with such layers has), else ``None``; ``load``:
    import it where bitsandbytes is installed (``patch_peft``, for layers made later)."""
    module = sys.modules.get(_PEFT_BNB)
    if module is None and load:
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is not None:
            module = importlib.import_module(_PEFT_BNB)
    return getattr(module, kind, None)


def _peft_forward(kind: str):
    """PEFT's own ``forward`` of its class, taken before ``patch`` replaces it."""
    if kind not in _peft_forwards:
        forward = peft_class(kind).__dict__["forward"]
        assert forward is not _lean_forward, "PEFT's forward was replaced before it was kept"
        _peft_forwards[kind] = forward
    return _peft_forwards[kind]


def patch(on: bool) -> None:
    """``patch_peft``'s part: PEFT's classes take ``_lean_forward`` (``on``) or their own forward back."""
    for kind in KINDS:
        cls = peft_class(kind, load=on)
        if cls is None:
            continue
        peft_forward = _peft_forward(kind)  # (kept before the first patch replaces it)
        cls.forward = _lean_forward if on else peft_forward
        if on:
            cls._flashdora_kind = kind
        elif "_flashdora_kind" in cls.__dict__:
            del cls._flashdora_kind


def pairs() -> list[tuple[type, type]]:
    """``(PEFT's class, flashdora's)`` for each bitsandbytes class PEFT has loaded."""
    return [(cls, flash_class(kind)) for kind in KINDS if (cls := peft_class(kind)) is not None]


def flash_class(kind: str) -> type:
    """``FlashDora<kind>`` (made on first use)."""
    if kind not in _flash_classes:
        import importlib

        peft_cls = getattr(importlib.import_module(_PEFT_BNB), kind)
        _peft_forward(kind)
        name = f"FlashDora{kind}"
        _flash_classes[kind] = type(name, (peft_cls,), {
            "forward": _lean_forward,
            "_flashdora_kind": kind,
            "_get_name": lambda self, _kind=kind: _kind,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"PEFT's ``lora.bnb.{kind}`` with flashdora's forward (printed as PEFT's class).",
        })  # fmt: skip
    return _flash_classes[kind]


def __getattr__(name: str):
    kind = name.removeprefix("FlashDora")
    if name.startswith("FlashDora") and kind in KINDS:
        return flash_class(kind)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
