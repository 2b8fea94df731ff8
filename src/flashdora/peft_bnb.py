"""PEFT's LoRA layer for bitsandbytes 4-bit bases (``peft.tuners.lora.bnb.Linear4bit``, what PEFT wraps a
``Linear4bit`` in where bitsandbytes is installed), as ``enable`` re-classes it: ``FlashDoraLinear4bit``.

Its forward is PEFT's on every call flashdora does not run; on a plain call of one active flashdora adapter it is
PEFT's function without PEFT's per-call dispatch, and the base result comes from ``base4bit.result`` (the same
values as the layer's own call, a fraction of its host time, and the dense weight handed to a norm-cache miss).

The class is made on first use (``FlashDoraLinear4bit`` is this module's attribute, PEP 562), so that importing
flashdora never imports bitsandbytes; a pickled model that holds one finds it the same way.
"""

from __future__ import annotations

import sys

import torch

from flashdora import base4bit
from flashdora import peft_integration as _pi  # (a cycle: read at call time)
from flashdora.layers import param as _param
from flashdora.ops.compose import after_base

_PEFT_BNB = "peft.tuners.lora.bnb"
_classes: dict[str, type] = {}


def _lean_forward_4bit(self, x, *args, **kwargs):
    """``FlashDoraLinear4bit.forward``, and PEFT's ``lora.bnb.Linear4bit.forward`` while ``patch_peft`` is on."""
    active = self._active_adapter
    if type(active) is not str:
        active = active[0] if len(active) == 1 else None
    mods = self._modules
    a_layers = mods["lora_A"]._modules
    if (
        args or kwargs or active is None or self._disable_adapters or self.merged_adapters or active not in a_layers
        or not _pi._runs_flashdora(type(self.lora_variant.get(active)))
    ):  # fmt: skip
        return _peft_forward()(self, x, *args, **kwargs)
    seq = after_base()
    result, fresh = base4bit.result(mods["base_layer"], x)
    if not fresh:
        result = result.clone()  # PEFT's defensive copy of bitsandbytes' output
    if torch.is_autocast_enabled():  # (PEFT's test: no conversion of x or of the result under autocast)
        result = _pi.flash_forward(self, active, x, result, seq)
    else:
        dtype = result.dtype
        x = self._cast_input_dtype(x, _param(a_layers[active], "weight").dtype)
        result = _pi.flash_forward(self, active, x, result, seq).to(dtype)
    if fresh:
        base4bit.release()
    return result


def peft_class(load: bool = False) -> type | None:
    """PEFT's ``lora.bnb.Linear4bit`` where PEFT has loaded it (a model with such layers has), else ``None``;
    ``load``: import it where bitsandbytes is installed (``patch_peft``, for layers made later)."""
    module = sys.modules.get(_PEFT_BNB)
    if module is None and load:
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is not None:
            module = importlib.import_module(_PEFT_BNB)
    return getattr(module, "Linear4bit", None)


def _peft_forward():
    """PEFT's own ``forward`` of its class, taken before ``patch`` replaces it."""
    if "peft" not in _classes:
        forward = peft_class().__dict__["forward"]
        assert forward is not _lean_forward_4bit, "PEFT's forward was replaced before it was kept"
        _classes["peft"] = forward
    return _classes["peft"]


def patch(on: bool) -> None:
    """``patch_peft``'s part: PEFT's class takes ``_lean_forward_4bit`` (``on``) or its own forward back."""
    cls = peft_class(load=on)
    if cls is None:
        return
    peft_forward = _peft_forward()  # (kept before the first patch replaces it)
    cls.forward = _lean_forward_4bit if on else peft_forward


def flash_class() -> type:
    """``FlashDoraLinear4bit`` (made on first use)."""
    if "flash" not in _classes:
        import importlib

        peft_cls = importlib.import_module(_PEFT_BNB).Linear4bit
        _peft_forward()
        _classes["flash"] = type("FlashDoraLinear4bit", (peft_cls,), {
            "forward": _lean_forward_4bit,
            "_get_name": lambda self: "Linear4bit",
            "__module__": __name__,
            "__qualname__": "FlashDoraLinear4bit",
            "__doc__": "PEFT's ``lora.bnb.Linear4bit`` with flashdora's forward (printed as PEFT's class).",
        })  # fmt: skip
    return _classes["flash"]


def __getattr__(name: str):
    if name == "FlashDoraLinear4bit":
        return flash_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
