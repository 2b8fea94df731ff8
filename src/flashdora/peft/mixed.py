"""PEFT's ``adapter_names`` (a batch whose requests use different adapters) on flashdora-enabled models, DoRA
adapters included, which PEFT itself refuses ("Cannot pass `adapter_names` when DoRA is enabled").

PEFT's layer-level mixed batch (``_mixed_batch_forward``) already runs a DoRA adapter's variant on its sub-batch;
only its argument check refuses DoRA. On an enabled model a LoRA Linear layer's call with ``adapter_names`` comes
here: PEFT's other checks (lengths, merged adapters; training mode is checked by PEFT's model), then one route
(``dispatch.mixed_route``): the fused mixed compose (``ops.mixed``) over a ``Pack`` of the layer's named adapters,
kept for as long as their weights and norms are unchanged; or PEFT's sub-batch loop (``peft:mixed-batch:<why>``),
where each DoRA adapter still runs flashdora's single-adapter route.
"""

from __future__ import annotations

import torch
from torch import nn

from flashdora import backend, config, dispatch
from flashdora.ops import norm_cache
from flashdora.ops.cache_streams import capturing
from flashdora.ops.mixed import Pack, build_pack, mixed_compose
from flashdora.ops.norm_cache import NormCache, dora_scales
from flashdora.peft import variant, watch
from flashdora.peft.support import hooked, hooked_adapter, is_bnb, param
from flashdora.peft.support import reason as support_reason

_SLOTS_KEPT = 64  # distinct adapter_names lists whose slot tensors a pack keeps (a server reuses a few)


def check_args(module, x, adapter_names) -> None:
    """PEFT's ``LoraLayer._check_forward_args`` for ``adapter_names``, with PEFT's messages, except its refusal of
    DoRA adapters."""
    if len(x) != len(adapter_names):
        raise ValueError(
            "Length of `adapter_names` should be the same as the number of inputs, but got "
            f"{len(adapter_names)} and {len(x)} respectively."
        )
    if module.merged:
        raise ValueError(
            "Cannot pass `adapter_names` when there are merged adapters, please call `unmerge_adapter` first."
        )


def forward(module, x, args, kwargs, peft_mixed):
    """A LoRA layer's call with ``adapter_names`` (``kwargs``); ``peft_mixed``: PEFT's ``_mixed_batch_forward``."""
    kwargs = dict(kwargs)
    names = kwargs.pop("adapter_names")
    check_args(module, x, names)
    base = module._modules["base_layer"]
    if module._disable_adapters:
        return base(x, *args, **kwargs)
    base_kind = "layer" if is_bnb(base) else "module"
    present = module._modules["lora_A"]._modules
    adapters = tuple(sorted({n for n in names if n in present}))
    pack = None if torch.compiler.is_compiling() else _kept(module, base, adapters, x, args, kwargs)
    # (a kept pack: nothing it was built from has changed, and no hook or gradient asks for PEFT's loop)
    why = None if pack is not None else reason(module, adapters, x, args, kwargs)
    route = dispatch.mixed_route(module, adapters, x, base_kind, why)
    if route.compose == "peft":
        backend.count(f"peft_fallback:{route.why}")
        backend.warn_once(
            f"fallback:{route.why}",
            f"flashdora: a mixed-adapter batch runs PEFT's per-adapter loop for a layer ({route.why}); "
            "the fused path needs eval mode and no gradients (torch.inference_mode())",
        )
        return peft_mixed(module, x, *args, adapter_names=names, **kwargs)
    if route.compose != "mixed-traced":  # (a counter read inside torch.compile would guard on its value)
        backend.count(route.compose)
    result = base(x)
    if not adapters:
        return result
    pack = pack or _pack(module, base, adapters, x, route)
    lora_A = pack.lora_A
    if not is_bnb(base) or not torch.is_autocast_enabled():  # (PEFT's cast of x to the adapters' dtype)
        x = x if x.dtype == lora_A.dtype else x.to(lora_A.dtype)
    y = mixed_compose(route.compose, result, x, pack, _slots(module, pack, names, x.device), param(base, "bias"))
    return y if y.dtype == result.dtype else y.to(result.dtype)


def reason(module, adapters, x, args, kwargs) -> str | None:
    """Why this mixed call runs PEFT's sub-batch loop, or ``None`` (the fused mixed compose runs it)."""
    if args or kwargs:
        return "arguments"  # (aLoRA offsets and other variant arguments: PEFT's code)
    if module.training:
        return "training"  # (dropout on each sub-batch; PEFT's model refuses adapter_names in training mode)
    if not config.peft_tested():
        return "peft-version"
    if backend.functorch_active():
        return "torch.func"
    mods = module._modules
    base = mods["base_layer"]
    weight = param(base, "weight")
    if torch.compiler.is_compiling() and is_bnb(base):
        return "quantized:compile"
    if x.device != weight.device:
        return "devices:input"
    grad = torch.is_grad_enabled() and x.requires_grad
    dtype = None
    for adapter in adapters:
        lora_A_layer, lora_B_layer = mods["lora_A"]._modules[adapter], mods["lora_B"]._modules[adapter]
        lora_A, lora_B = param(lora_A_layer, "weight"), param(lora_B_layer, "weight")
        kind = module.lora_variant.get(adapter)
        if kind is None:  # a LoRA adapter
            if param(lora_B_layer, "bias") is not None:
                return "lora_bias"
            if not (isinstance(lora_A_layer, nn.Linear) and isinstance(lora_B_layer, nn.Linear)):
                return f"lora:{type(lora_A_layer).__name__}"
            hook = hooked(lora_A_layer, lora_B_layer)
            if hook is None and lora_A.device != weight.device:
                return "devices:adapter and base weight on different devices"
        elif not variant._runs_flashdora(type(kind)):
            return f"variant:{type(kind).__name__}"
        else:
            magnitude = param(mods["lora_magnitude_vector"]._modules[adapter], "weight")
            why = support_reason(base, weight, lora_A, lora_B_layer, lora_B, magnitude)
            if why is not None:
                return why
            hook = hooked_adapter(module, adapter)
            grad = grad or (torch.is_grad_enabled() and magnitude.requires_grad)
        if hook is not None:
            return f"hooks:{hook}"
        if (hook := hooked(mods["lora_dropout"]._modules[adapter])) is not None:
            return f"hooks:{hook}"
        if dtype is not None and lora_A.dtype != dtype:
            return "dtypes:adapters of different dtypes"
        dtype = lora_A.dtype
        grad = grad or (torch.is_grad_enabled() and (lora_A.requires_grad or lora_B.requires_grad))
    if grad:
        return "grad"  # (gradients: PEFT's loop, whose DoRA adapters run flashdora's differentiable route)
    return None


def _tensors(module, adapters) -> list:
    """The adapter tensors a pack is built from: each adapter's A, B and (DoRA) magnitude."""
    mods = module._modules
    loras_A, loras_B = mods["lora_A"]._modules, mods["lora_B"]._modules
    magnitudes, variants = mods["lora_magnitude_vector"]._modules, module.lora_variant
    out = []
    for adapter in adapters:
        out.append(param(loras_A[adapter], "weight"))
        out.append(param(loras_B[adapter], "weight"))
        if adapter in variants:
            out.append(param(magnitudes[adapter], "weight"))
    return out


def _fingerprint(module, base, adapters, x, tensors) -> tuple:
    """What a kept pack must have been built from to serve this call: the base weight's norm-cache key, each adapter
    tensor's identity, address and version (the pack holds them and their storage, so neither an id nor an address
    can be reused while it lives), the scalings, the input dtype, the optimizer steps and events."""
    weight = param(base, "weight")
    weight = weight.detach() if is_bnb(base) else weight  # (a plain alias: see peft.variant.flash_forward)
    scaling = module.scaling
    return (
        adapters, x.dtype, x.device, norm_cache._key(weight), tuple(scaling[a] for a in adapters), norm_cache._steps,
        norm_cache._events, tuple((id(t), t.data_ptr(), t._version) for t in tensors),
    )  # fmt: skip


def _kept(module, base, adapters, x, args, kwargs) -> Pack | None:
    """The layer's kept pack when this call may use it without asking the norm cache (host time per layer call:
    one key per layer, three reads per adapter tensor, the hook checks), else ``None``: ``forward`` then routes it
    in full."""
    pack = module.__dict__.get("_flashdora_mixed")
    if (
        pack is None
        or args
        or kwargs
        or module.training
        or torch.is_grad_enabled()
        or backend.functorch_active()
    ):  # fmt: skip
        return None
    if adapters != pack.adapters or not _unchanged(module, base, adapters, x):
        return None
    mods = module._modules
    modules = []
    for adapter in pack.adapters:
        modules.append(mods["lora_A"]._modules[adapter])
        modules.append(mods["lora_B"]._modules[adapter])
        modules.append(mods["lora_dropout"]._modules[adapter])
        if adapter in module.lora_variant:
            modules.append(mods["lora_magnitude_vector"]._modules[adapter])
    if hooked(*modules) is not None:
        return None
    return pack


def _unchanged(module, base, adapters, x) -> bool:
    """Whether the layer's kept pack was built from what this call would build it from (``_fingerprint``)."""
    held = module.__dict__.get("_flashdora_mixed_held")
    if held is None or not norm_cache.cache_enabled() or watch.fsdp_hook is not None or (x.is_cuda and capturing()):
        # (FSDP2 re-fills gathered weights in place: the norm cache's shard keys, every call; a CUDA graph being
        # captured builds its own pack, so that each replay reads the weights as they are then)
        return False
    return _fingerprint(module, base, adapters, x, _tensors(module, adapters)) == held[0]


def _pack(module, base, adapters, x, route) -> Pack:
    """The layer's ``Pack`` of ``adapters``: the kept one while ``_fingerprint`` holds (what the norm cache keys
    each DoRA adapter's scales on, and every LoRA adapter's weights), else built from the norm cache's scales and
    kept; built inside ``torch.compile`` and CUDA graph capture on every call, kept nowhere."""
    compiling = torch.compiler.is_compiling()
    kept = module.__dict__.get("_flashdora_mixed")
    if not compiling and kept is not None and kept.adapters == adapters and _unchanged(module, base, adapters, x):
        return kept
    mods = module._modules
    weight = param(base, "weight")
    quantized = is_bnb(base)
    if quantized:
        weight = weight.detach()  # (a plain alias of the packed weight: see peft.variant.flash_forward)
    elif module.fan_in_fan_out:
        weight = weight.T
    lora_As, lora_Bs, scalings, scales = [], [], [], []
    for adapter in adapters:
        lora_A = param(mods["lora_A"]._modules[adapter], "weight")
        lora_B = param(mods["lora_B"]._modules[adapter], "weight")
        scaling = float(module.scaling[adapter])
        lora_As.append(lora_A)
        lora_Bs.append(lora_B)
        scalings.append(scaling)
        owner = mods["lora_magnitude_vector"]._modules.get(adapter) if adapter in module.lora_variant else None
        if owner is None:
            scales.append(None)
        elif compiling:
            magnitude = param(owner, "weight")
            scales.append(dora_scales(weight, lora_A, lora_B, magnitude, scaling, variant._cache_id(owner)))
        else:
            scales.append(NormCache.lookup_owner(
                weight, lora_A, lora_B, param(owner, "weight"), scaling, variant._cache_owner(owner),
                base if quantized else None, x.dtype, impl=route.norm,
            ))  # fmt: skip
    pack = build_pack(adapters, lora_As, lora_Bs, scalings, scales)
    if not compiling and norm_cache.cache_enabled() and not (x.is_cuda and capturing()):
        tensors = _tensors(module, adapters)
        module.__dict__["_flashdora_mixed"] = pack
        # (the tensors and their storage held: their ids and addresses are in the fingerprint)
        module.__dict__["_flashdora_mixed_held"] = (
            _fingerprint(module, base, adapters, x, tensors), tensors, [t.detach() for t in tensors]
        )  # fmt: skip
    return pack


def _slots(module, pack: Pack, names, device) -> torch.Tensor:
    """``[B]`` int32: each request's slot in ``pack`` (0: ``"__base__"`` or an adapter this layer does not have).
    Kept on the layer per (adapters, names) list: the same tensor for every call of a ``generate`` and for a CUDA
    graph captured after a first eager call (a list first seen inside capture is filled on the device there)."""
    slot_of = {adapter: k for k, adapter in enumerate(pack.adapters, start=1)}
    values = [slot_of.get(n, 0) for n in names]
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.int32, device=device)
    kept = module.__dict__.get("_flashdora_slots")
    if kept is None:
        kept = module.__dict__["_flashdora_slots"] = {}
    key = (pack.adapters, tuple(names), device)
    slots = kept.get(key)
    if slots is not None:
        return slots
    if device.type == "cuda" and capturing():  # no copy from the host inside capture
        slots = torch.zeros(len(values), dtype=torch.int32, device=device)
        for i, v in enumerate(values):
            if v:
                slots[i] = v
        return slots
    if len(kept) >= _SLOTS_KEPT:
        kept.clear()
    slots = kept[key] = torch.tensor(values, dtype=torch.int32).to(device)
    return slots
