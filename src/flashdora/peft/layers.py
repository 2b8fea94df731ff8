"""PEFT's LoRA layer classes as ``enable`` re-classes them, and their forwards (``patch_peft`` gives PEFT's own
classes the same forwards).

- ``FlashDoraLinear`` (PEFT's generic ``Linear``) and ``FlashDoraLinear4bit`` / ``FlashDoraLinear8bitLt`` (PEFT's
  ``lora.bnb`` classes, what a model loaded quantized gets): on a plain call of one active flashdora adapter, PEFT's
  function without PEFT's per-call dispatch (argument checks, properties, module-dict lookups, keyword plumbing: host
  time a model pays on every layer call); PEFT's own forward on every other call. A bitsandbytes base's result comes
  from ``quant.base.run`` as ``dispatch.base_plan`` decided (the same values as the layer's own call, a fraction of
  its host time).
- ``cast_input_dtype``: PEFT's cast of a layer's input to the adapters' dtype, skipped where it changes no value.

The bitsandbytes classes are made on first use (module attributes, PEP 562), so that importing flashdora never
imports bitsandbytes; a pickled class is found the same way.
"""

from __future__ import annotations

import sys

import torch
from peft.tuners.lora.layer import Linear as PeftLinear
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from flashdora import dispatch
from flashdora._dtypes import autocast_on
from flashdora.ops.compose import after_base
from flashdora.peft import mixed, variant
from flashdora.peft.mixed_hooks import NAMES
from flashdora.peft.support import hooked_adapter
from flashdora.peft.support import is_bnb as _bnb
from flashdora.peft.support import param as _param
from flashdora.quant import base as bnb_base

_PEFT_LINEAR_FORWARD = PeftLinear.forward
_PEFT_BNB = "peft.tuners.lora.bnb"
KINDS = ("Linear4bit", "Linear8bitLt")
_CLONES = {"Linear4bit": True, "Linear8bitLt": False}  # PEFT's forward clones a 4-bit layer's output, not an 8-bit's
_peft_forwards: dict[str, object] = {}
_flash_classes: dict[str, type] = {}


_PEFT_CAST = LoraLayer._cast_input_dtype


def cast_input_dtype(self, x, dtype: torch.dtype):
    """PEFT's cast of a LoRA layer's input to the adapters' dtype, skipped where it cannot change any value: under
    autocast, on layers whose active adapters all run flashdora (no active dropout, or ``dropout="adapter"``), a
    16-bit ``x`` goes as it is, saving a cast each way (docs/host-notes.md). Elsewhere PEFT's runs."""
    if (
        x is not None
        and x.dtype != dtype
        and autocast_on(x.device.type)
        and x.dtype == torch.get_autocast_dtype(x.device.type)
    ):
        variants_ = self.lora_variant
        dropouts = self._modules["lora_dropout"]._modules
        training = self.training
        for adapter in self.active_adapters:
            if adapter not in variants_:
                if adapter in self._modules["lora_A"]._modules:
                    break  # a vanilla LoRA adapter: PEFT's own path
                continue
            if not variant._runs_flashdora(type(variants_[adapter])) or hooked_adapter(self, adapter) is not None:
                break  # (a layer with hooks on its adapter modules runs PEFT's forward, on PEFT's input)
            if training and not isinstance(dropouts[adapter], nn.Identity) and variant.dropout_mode(self) != "adapter":
                break
        else:
            return x
    return _PEFT_CAST(self, x, dtype)


class FlashDoraLinear(PeftLinear):
    """PEFT's LoRA ``Linear``, as ``enable`` re-classes a model's layers: a plain call whose one active adapter runs
    flashdora goes straight to it; any other call runs PEFT's own ``Linear.forward``.

    The same function as PEFT's (``base_layer(x)``, PEFT's cast of ``x``, the variant's forward, the result in the
    base layer's dtype), without PEFT's per-call dispatch: argument checks, properties, module-dict lookups and
    keyword plumbing, host time a model pays on every layer call. Printed as PEFT's class.
    """

    def forward(self, x, *args, **kwargs):
        return lean_forward(self, x, *args, **kwargs)

    _cast_input_dtype = cast_input_dtype
    _flashdora_reads_names = True  # (its forward takes adapter_names from mixed_hooks.NAMES)

    def _get_name(self):
        return "Linear"


def plain_active(self, args, kwargs) -> str | None:
    """The one active adapter of a LoRA layer's plain call (no extra arguments, adapters on, nothing merged) that
    flashdora runs, else ``None`` (PEFT's own forward then runs)."""
    active = self._active_adapter
    if type(active) is not str:
        active = active[0] if len(active) == 1 else None
    if (
        args or kwargs or active is None or self._disable_adapters or self.merged_adapters
        or active not in self._modules["lora_A"]._modules
    ):  # fmt: skip
        return None
    return active if variant._runs_flashdora(type(self.lora_variant.get(active))) else None


def lean_forward(self, x, *args, **kwargs):
    """``FlashDoraLinear.forward``, and PEFT's ``Linear.forward`` while ``patch_peft`` is on."""
    if (kwargs or NAMES in self.__dict__) and (y := _mixed(self, x, args, kwargs)) is not None:
        return y
    active = plain_active(self, args, kwargs)
    if active is None:
        return _PEFT_LINEAR_FORWARD(self, x, *args, **kwargs)
    native = dispatch.native_for(self, x)  # (before the base: a 4-bit base's route depends on it)
    base = self._modules["base_layer"]
    if native and (y := variant.fused_forward(self, active, x, base)) is not None:
        return y  # (the base layer, the LoRA A matmul and the compose in one C++ call)
    seq = after_base()
    if not _bnb(base):
        return _adapt(self, active, x, base(x), seq, "module", native)
    try:
        result, fresh = bnb_base.run(base, x, dispatch.base_plan(base, x, native))
        return _adapt(self, active, x, result, seq, "bnb" if fresh else "layer", native)
    finally:
        bnb_base.release()  # (the dense weight a 4-bit forward held for the miss)


def _mixed(self, x, args, kwargs):
    """A mixed-adapter batch's call (``peft/mixed.py``), its names from PEFT's hook (``adapter_names``) or set by
    ``peft.mixed_hooks``; ``None`` for any other call."""
    if kwargs.get("adapter_names") is None:
        if NAMES not in self.__dict__:
            return None
        kwargs = {**kwargs, "adapter_names": self.__dict__[NAMES]}
    return mixed.forward(self, x, args, kwargs, type(self)._mixed_batch_forward)


def _adapt(self, active, x, result, seq, base_kind, native):
    """``lean_forward`` after the base layer: PEFT's cast of ``x``, the variant, the result in the base's dtype."""
    dtype = result.dtype
    x = self._cast_input_dtype(x, _param(self._modules["lora_A"]._modules[active], "weight").dtype)
    result = variant.flash_forward(self, active, x, result, seq, base_kind, _native=native)
    return result if result.dtype == dtype else result.to(dtype)


def swap_linear_class(model: nn.Module, flash: bool) -> None:
    """PEFT's LoRA ``Linear`` (and ``lora.bnb``) layers of ``model`` re-classed as flashdora's (``flash``) or PEFT's
    own."""
    classes = [(PeftLinear, FlashDoraLinear), *pairs()]
    for module in model.modules():
        for peft_cls, flash_cls in classes:
            if type(module) in (peft_cls, flash_cls):
                module.__class__ = flash_cls if flash else peft_cls


def _lean_forward_bnb(self, x, *args, **kwargs):
    """``FlashDoraLinear4bit.forward`` / ``FlashDoraLinear8bitLt.forward``, and PEFT's own classes' forward while
    ``patch_peft`` is on."""
    if (kwargs or NAMES in self.__dict__) and (y := _mixed(self, x, args, kwargs)) is not None:
        return y
    active = plain_active(self, args, kwargs)
    if active is None:
        return _peft_forward(self._flashdora_kind)(self, x, *args, **kwargs)
    mods = self._modules
    native = dispatch.native_for(self, x)
    seq = after_base()
    try:
        result, fresh = bnb_base.run(mods["base_layer"], x, dispatch.base_plan(mods["base_layer"], x, native))
        if not fresh and _CLONES[self._flashdora_kind]:
            result = result.clone()  # PEFT's defensive copy of bitsandbytes' 4-bit output
        base_kind = "bnb" if fresh else "layer"
        if torch.is_autocast_enabled():  # (PEFT's test: no conversion of x or of the result under autocast)
            return variant.flash_forward(self, active, x, result, seq, base_kind, _native=native)
        dtype = result.dtype
        x = self._cast_input_dtype(x, _param(mods["lora_A"]._modules[active], "weight").dtype)
        return variant.flash_forward(self, active, x, result, seq, base_kind, _native=native).to(dtype)
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
        assert forward is not _lean_forward_bnb, "PEFT's forward was replaced before it was kept"
        _peft_forwards[kind] = forward
    return _peft_forwards[kind]


def patch_bnb(on: bool) -> None:
    """``patch_peft``'s part for PEFT's bitsandbytes classes: ``_lean_forward_bnb`` (``on``) or their own forward."""
    for kind in KINDS:
        cls = peft_class(kind, load=on)
        if cls is None:
            continue
        peft_forward = _peft_forward(kind)  # (kept before the first patch replaces it)
        cls.forward = _lean_forward_bnb if on else peft_forward
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
            "forward": _lean_forward_bnb,
            "_flashdora_kind": kind,
            "_flashdora_reads_names": True,
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
