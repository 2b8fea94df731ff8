"""The hooks by which the norm cache sees writes that no version counter shows (``ops/norm_cache.py``).

Each calls ``norm_cache.bump()``: every layer recomputes its norm at its next forward. ``enable`` installs the
per-model ones; PEFT's hotswap functions are wrapped once, when flashdora's PEFT seam is imported.
"""

from __future__ import annotations

import functools

import torch
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from flashdora.ops import norm_cache


def _bumping(fn):
    """``fn``, telling the norm cache when it returns (or raises: a write may have happened)."""

    @functools.wraps(fn)
    def watched(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            norm_cache.bump()

    watched._flashdora_watched = True
    return watched


def _loaded(module, incompatible_keys) -> None:
    """``load_state_dict`` post-hook of an enabled LoRA layer: under FSDP2 the values land in the sharded parameters,
    whose version counters the unsharded ones do not share."""
    norm_cache.bump()


def _gathered(module, args) -> None:
    """Forward pre-hook of an FSDP2 module: FSDP2 re-fills the same unsharded storage on every all-gather, without
    moving its version counter, so whatever reaches the sharded parameters (an in-place edit, a load) is seen here."""
    norm_cache.bump()


def _fsdp_module_class():
    """FSDP2's ``FSDPModule`` (public from torch 2.6; the ``_composable`` path before), or ``None``."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def watch_writes(model: nn.Module, on: bool) -> None:
    """Install (``on``) or remove the hooks by which the norm cache sees writes the version counters miss: a
    ``load_state_dict`` post-hook on every LoRA layer and a forward pre-hook on every FSDP2 module of ``model``."""
    fsdp = _fsdp_module_class() if on else None
    for module in model.modules():
        for handle in module.__dict__.pop("_flashdora_hooks", ()):
            handle.remove()
        if not on:
            continue
        hooks = []
        if isinstance(module, LoraLayer):
            hooks.append(module.register_load_state_dict_post_hook(_loaded))
        if fsdp is not None and isinstance(module, fsdp):
            hooks.append(module.register_forward_pre_hook(_gathered))
        if hooks:
            module.__dict__["_flashdora_hooks"] = hooks


def watch_hotswap() -> None:
    """PEFT's hotswap writes adapter weights through ``.data``, where no version counter moves: its public functions
    (``peft.utils.hotswap``) are wrapped, at import, to tell the norm cache. Code that took the function objects
    before ``import flashdora`` calls PEFT's own: ``flashdora.invalidate()`` after it (README)."""
    try:
        from peft.utils import hotswap
    except ImportError:
        return
    for name in ("hotswap_adapter_from_state_dict", "hotswap_adapter"):
        fn = getattr(hotswap, name, None)
        if fn is None or getattr(fn, "_flashdora_watched", False):
            continue
        setattr(hotswap, name, _bumping(fn))


watch_hotswap()
