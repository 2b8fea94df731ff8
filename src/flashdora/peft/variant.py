"""flashdora's DoRA Linear ``LoraVariant`` (``FlashDoraLinearVariant``) and its forward, ``flash_forward``: one
routing decision per call (``dispatch``), then the norm cache and the compose. ``peft.switch`` switches models
and PEFT's classes to it; ``peft.layers`` calls ``flash_forward`` from PEFT's layer forwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora import variants
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from flashdora import backend, dispatch
from flashdora.native import bridge
from flashdora.ops.compose import run_compose
from flashdora.ops.norm_cache import NormCache, dora_scales
from flashdora.peft import watch
from flashdora.peft.support import base_layer, dequantized, is_bnb, param, plain_base

_PEFT_DORA = variants.DoraLinearVariant
_PEFT_FORWARD = _PEFT_DORA.__dict__["forward"]  # the staticmethod object, restored by unpatch_peft


def _fallback(reason: str, peft_forward, module, active_adapter, x, result, **kwargs):
    backend.count(f"peft_fallback:{reason}")
    backend.warn_once(
        f"fallback:{reason}", f"flashdora: running PEFT's own DoRA for a layer it does not handle ({reason})"
    )
    return peft_forward(module, active_adapter, x, result, **kwargs)


_PLAIN = (torch.Tensor, nn.Parameter)


def flash_forward(
    module: LoraLayer, active_adapter: str, x: torch.Tensor, result: torch.Tensor, _seq=-1, _base=None, _native=None,
    **kwargs,
):
    """``LoraVariant.forward`` for DoRA Linear layers: PEFT's function, computed by ``flashdora.ops``.

    The call is routed once (``dispatch.layer_route``) and run as its route says. ``_seq``:
    ``ops.compose.after_base()`` taken right before the base layer ran (``peft.layers``), else -1. ``_base``: how the
    base result was made (``dispatch.BASE``; ``None``: the layer's own call). ``_native``: ``dispatch.native_for``'s
    answer, where the caller took it before the base ran."""
    if watch.fsdp_hook is None:  # a process group may have come up since (FSDP2: peft/watch.py)
        watch.watch_fsdp()
    if "_flashdora_pending" in module.__dict__:  # FSDP2 has just gathered this layer's weights
        watch.shards(module)
    mods = module._modules
    base = base_layer(module)
    weight = param(base, "weight")
    quantized = is_bnb(base)
    if type(weight) not in _PLAIN and getattr(weight, "_flashdora_shard", None) is None:
        # A parameter subclass with its own __torch_function__ (bitsandbytes' Params4bit and Int8Params): every read of
        # an attribute (the norm cache's key takes eight) runs it. detach() is the same storage, address and version
        # counter as a plain tensor: the same key, read at a plain tensor's cost. (FSDP2's tagged parameters keep
        # theirs: the tag lives on the parameter.)
        weight = weight.detach()
    lora_A = param(mods["lora_A"]._modules[active_adapter], "weight")
    lora_B_layer = mods["lora_B"]._modules[active_adapter]
    lora_B = param(lora_B_layer, "weight")
    owner = mods["lora_magnitude_vector"]._modules[active_adapter]
    magnitude = param(owner, "weight")
    bias = param(base, "bias")
    dropout = mods["lora_dropout"]._modules[active_adapter]
    drops = module.training and not isinstance(dropout, nn.Identity)
    exact = drops and dropout_mode(module) != "adapter"
    route = dispatch.layer_route(
        module, active_adapter, base, weight, lora_A, lora_B_layer, lora_B, magnitude, x, result,
        _base or ("layer" if quantized else "module"), bias, exact,
        dispatch.native_for(module, x) if _native is None else _native,
    )  # fmt: skip
    compose = route.compose
    if compose == "meta":  # shapes only (meta-device initialisation): PEFT's ops, uncounted as a fallback
        backend.count("meta")
        return _PEFT_FORWARD.__func__(module, active_adapter, x, result, **kwargs)
    if compose == "peft":
        return _fallback(route.why, _PEFT_FORWARD.__func__, module, active_adapter, x, result, **kwargs)
    weight = weight.T if module.fan_in_fan_out else weight
    scaling = float(module.scaling[active_adapter])
    if compose == "traced":
        scales = dora_scales(weight, lora_A, lora_B, magnitude, scaling, _cache_id(owner))
    else:  # eager: the cache by its owner
        scales = NormCache.lookup_owner(
            weight, lora_A, lora_B, magnitude, scaling, _cache_owner(owner), base if quantized else None, x.dtype,
            impl=route.norm,
        )  # fmt: skip
    if not drops:
        return run_compose(compose, result, x, lora_A, lora_B, magnitude, scales, scaling, bias=bias, seq=_seq)
    lora_x = dropout(x)
    if not exact:  # dropout on the low-rank branch only
        return run_compose(compose, result, lora_x, lora_A, lora_B, magnitude, scales, scaling, bias=bias, seq=_seq)
    # PEFT forms lora_x W^T with W cast to the input dtype; under autocast that cast is a no-op on values.
    autocast = torch.is_autocast_enabled(x.device.type)
    if quantized:  # (as PEFT's QDoRA; an 8-bit weight straight in the dtype the matmul runs in)
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else lora_x.dtype
        fast = dispatch.dequantizer(compose == "native")
        w = dequantized(base, None if module.fan_in_fan_out else weight, dtype, fast)
    else:
        w = weight
    w = w if autocast else w.to(lora_x.dtype)
    lx_base = F.linear(lora_x, w)
    return run_compose(compose, result, lora_x, lora_A, lora_B, magnitude, scales, scaling, lx_base=lx_base)


FUSE = True  # the C++ layer call where it may run (``flashdora bench model``'s ``flashdora_split`` mode turns it off)


def fused_forward(module: LoraLayer, active_adapter: str, x: torch.Tensor, base: nn.Module):
    """``peft.layers``' plain call of ``active_adapter`` on a layer whose base is ``base`` (``native_for`` said yes),
    before the base layer runs: the base matmul, the LoRA A matmul and the compose in one C++ call and, in training,
    one autograd node (``native.bridge.layer``; route ``native/native/native``), or ``None``: the caller runs the
    base layer and ``flash_forward``. Taken where nothing a user could see changes (``support.plain_base``), without
    dropout in training, with ``x`` and the weight already in the matmul dtype: PEFT's cast of ``x`` and of the
    result are then no-ops. Not in a process with a process group: flashdora's FSDP2 watch (a process-wide hook,
    installed here first, so that a process's first call takes the route of every later one and a checkpoint's
    recomputation saves what its forward saved) keeps every call on the split path."""
    if watch.fsdp_hook is None:  # (as flash_forward: a process group may have come up since)
        watch.watch_fsdp()
    if not FUSE or not plain_base(base, x) or module.fan_in_fan_out:
        return None
    mods = module._modules
    if module.training and not isinstance(mods["lora_dropout"]._modules[active_adapter], nn.Identity):
        return None
    weight = base._parameters["weight"]
    lora_A = param(mods["lora_A"]._modules[active_adapter], "weight")
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute = torch.get_autocast_dtype(device_type) if autocast else lora_A.dtype
    if x.dtype != compute or weight.dtype != compute or "_flashdora_pending" in module.__dict__:
        return None
    lora_B_layer = mods["lora_B"]._modules[active_adapter]
    lora_B = param(lora_B_layer, "weight")
    owner = mods["lora_magnitude_vector"]._modules[active_adapter]
    magnitude = param(owner, "weight")
    bias = base._parameters.get("bias")
    route = dispatch.fused_route(
        module, active_adapter, base, weight, lora_A, lora_B_layer, lora_B, magnitude, x, bias
    )
    if route is None:
        return None
    scaling = float(module.scaling[active_adapter])
    scales = NormCache.lookup_owner(
        weight, lora_A, lora_B, magnitude, scaling, _cache_owner(owner), None, x.dtype, impl=route.norm
    )
    return bridge.layer(x, weight, bias, lora_A, lora_B, magnitude, scales, scaling)


def _cache_id(owner) -> int:
    """The norm-cache id of a (layer, adapter)'s magnitude ``owner``: registered on first eager use, or by ``enable``
    (again for a copy of another model's layer, which carries that layer's id); -1 means none."""
    cache_id = owner.__dict__.get("_flashdora_cache_id")
    if cache_id is None or (cache_id != id(owner) and cache_id >= 0):
        if torch.compiler.is_compiling():
            return -1
        cache_id = owner._flashdora_cache_id = NormCache.register(owner)
    return cache_id


def _cache_owner(owner):
    """``_cache_id`` on the eager path: the owner itself, or ``None`` where its layer keeps no cache."""
    cache_id = owner.__dict__.get("_flashdora_cache_id")
    if cache_id == id(owner):
        return owner
    return None if _cache_id(owner) < 0 else owner


_FLASH_STATIC = staticmethod(flash_forward)


def _runs_flashdora(kind: type) -> bool:
    """Whether a variant of class ``kind`` runs flashdora's forward: ours, or PEFT's own while ``patch_peft`` is on."""
    return kind is FlashDoraLinearVariant or (kind is _PEFT_DORA and _PEFT_DORA.__dict__["forward"] is _FLASH_STATIC)


class FlashDoraLinearVariant(_PEFT_DORA):
    """PEFT's DoRA Linear variant with flashdora's forward (merge/unmerge/init stay PEFT's)."""

    forward = _FLASH_STATIC


class PeftDoraLinearVariant(_PEFT_DORA):
    """PEFT's DoRA Linear variant pinned to PEFT's own forward, whatever ``patch_peft`` says."""

    forward = _PEFT_FORWARD


DROPOUT_MODES = ("exact", "adapter")
_patch_dropout = "exact"  # patch_peft's mode, for layers enable() has not set


def dropout_mode(module: LoraLayer) -> str:
    """The dropout mode flashdora runs ``module`` with: ``enable``'s, else ``patch_peft``'s."""
    return module.__dict__.get("_flashdora_dropout", _patch_dropout)


def is_patched() -> bool:
    return _PEFT_DORA.__dict__["forward"].__func__ is flash_forward
