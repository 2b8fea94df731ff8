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

import itertools
import operator
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from flashdora import backend, config, dispatch
from flashdora.native import bridge as native_bridge
from flashdora.ops import norm_cache
from flashdora.ops.cache_streams import capturing
from flashdora.ops.mixed import Pack, build_pack, mixed_compose
from flashdora.ops.norm_cache import NormCache, dora_scales
from flashdora.peft import variant, watch
from flashdora.peft.support import global_hooks, hooked, hooked_adapter, is_bnb, param
from flashdora.peft.support import params_reason as _params_reason
from flashdora.peft.support import reason as support_reason

_PACK, _HELD = "_flashdora_mixed", "_flashdora_mixed_held"  # a layer's kept pack, what it was built from
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
    dtype = pack.lora_A_t.dtype
    if not is_bnb(base) or not torch.is_autocast_enabled():  # (PEFT's cast of x to the adapters' dtype)
        x = x if x.dtype == dtype else x.to(dtype)
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
        dropout = mods["lora_dropout"]._modules[adapter]
        if (hook := hooked(dropout)) is not None:
            return f"hooks:{hook}"
        if kind is None and (why := _dropout_reason(dropout)) is not None:
            return why
        if (why := _params_reason(mods, adapter)) is not None:
            return why
        if dtype is not None and lora_A.dtype != dtype:
            return "dtypes:adapters of different dtypes"
        dtype = lora_A.dtype
        grad = grad or (torch.is_grad_enabled() and (lora_A.requires_grad or lora_B.requires_grad))
    if grad:
        return "grad"  # (gradients: PEFT's loop, whose DoRA adapters run flashdora's differentiable route)
    return None


def _dropout_reason(dropout) -> str | None:
    """Why a LoRA adapter's dropout module is not the identity PEFT's loop would call in eval mode, else ``None``:
    PEFT calls it on the adapter's sub-batch whatever the layer's mode (a DoRA adapter's only in training mode)."""
    kind = type(dropout)
    if kind is nn.Identity or (kind is nn.Dropout and not dropout.training):
        return None
    return "dropout:training" if kind is nn.Dropout else f"dropout:{dropout._get_name()}"


class _Held(NamedTuple):
    """What a kept pack was built from (``_held``), laid out for ``_unchanged``'s C-level comparisons: host time per
    layer call is then about a tenth of a microsecond per adapter tensor and module, not a Python loop over them."""

    key: tuple  # _key: the base weight's norm-cache key, the scalings, the input, the optimizer steps and events
    parents: tuple  # (ModuleDict._modules, adapter) of each module PEFT calls (A, B, dropout, magnitude) ...
    modules: tuple  # ... and that module
    types: tuple  # their types
    dicts: tuple  # their instance dicts (an instance ``forward``)
    tensors: tuple  # the adapter tensors: each adapter's A, B and (DoRA) magnitude weight ...
    owners: tuple  # ... the ``_parameters`` dict holding each
    versions: tuple
    ptrs: tuple
    storage: list  # the tensors detached: their storage lives as long as the pack (no id or address reused)
    epoch: list  # [torch.utils.hooks.RemovableHandle.next_id] when ``modules`` were last found without hooks
    keys: tuple  # the parameter names of each of ``owners`` ...
    nones: tuple  # ... and (``_parameters``, name) of each but ``weight``, all ``None`` (``_params_reason``)
    dropouts: tuple  # the LoRA adapters' ``nn.Dropout`` modules, in eval mode (``_dropout_reason``)


_ADAPTER_DICTS = ("lora_A", "lora_B", "lora_dropout")
_VERSION = operator.attrgetter("_version")
_PTR = torch.Tensor.data_ptr
_WEIGHT = itertools.repeat("weight")
_FORWARD = itertools.repeat("forward")
_TRAINING = operator.attrgetter("training")
_NONE = itertools.repeat(None)


def _hook_epoch() -> int | None:
    """A process-wide count of hook registrations (every module hook's ``RemovableHandle`` takes the next id), or
    ``None`` where it cannot be read (``private_apis`` off, a torch without it): every call then checks the hooks."""
    return getattr(RemovableHandle, "next_id", None) if config.private else None


def _key(module, base, adapters, x) -> tuple:
    weight = param(base, "weight")
    weight = weight.detach() if is_bnb(base) else weight  # (a plain alias: see peft.variant.flash_forward)
    mods = module._modules
    scaling = module.scaling
    return (
        adapters, x.dtype, x.device, norm_cache._key(weight), tuple(map(scaling.__getitem__, adapters)),
        norm_cache._steps, norm_cache._events, mods["lora_A"], mods["lora_B"], mods["lora_dropout"],
        mods["lora_magnitude_vector"],
    )  # fmt: skip


def _held(module, base, adapters, x) -> _Held | None:
    """``_Held`` for a pack of ``adapters`` built now, ``None`` where an adapter's weight is not a registered
    parameter (a parametrization computes it on each read) or is an inference tensor (no version counter): nothing
    to keep."""
    mods = module._modules
    parents, modules, tensors, owners, dropouts = [], [], [], [], []
    for adapter in adapters:
        names = _ADAPTER_DICTS + (("lora_magnitude_vector",) if adapter in module.lora_variant else ())
        for name in names:
            parent = mods[name]._modules
            layer = parent[adapter]
            parents.append((parent, adapter))
            modules.append(layer)
            if name != "lora_dropout":
                params = layer._parameters
                if params.get("weight") is None:
                    return None
                tensors.append(params["weight"])
                owners.append(params)
            elif type(layer) is nn.Dropout and adapter not in module.lora_variant:
                dropouts.append(layer)
    if param(base, "weight").is_inference() or any(t.is_inference() for t in tensors):
        return None
    nones = tuple((params, key) for params in owners for key in params if key != "weight")
    return _Held(
        _key(module, base, adapters, x), tuple(parents), tuple(modules), tuple(map(type, modules)),
        tuple(m.__dict__ for m in modules), tuple(tensors), tuple(owners), tuple(map(_VERSION, tensors)),
        tuple(map(_PTR, tensors)), [t.detach() for t in tensors], [_hook_epoch()], tuple(map(tuple, owners)),
        nones, tuple(dropouts),
    )  # fmt: skip


def _kept(module, base, adapters, x, args, kwargs) -> Pack | None:
    """The layer's kept pack when this call may use it without asking the norm cache, else ``None``: ``forward``
    then routes it in full."""
    pack = module.__dict__.get(_PACK)
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
    return pack


def _keeps(module) -> bool:
    """Whether the layer may keep a pack: the norm cache on, process-wide and for its model (``enable``)."""
    return norm_cache.cache_enabled() and module.__dict__.get("_flashdora_norm_cache", True)


def _unchanged(module, base, adapters, x) -> bool:
    """Whether the layer's kept pack was built from what this call would build it from, and no module PEFT would
    call for it has gained a hook, an instance ``forward`` or another class since (``hooked``)."""
    held = module.__dict__.get(_HELD)
    if held is None or not _keeps(module) or watch.fsdp_hook is not None or (x.is_cuda and capturing()):
        # (FSDP2 re-fills gathered weights in place: the norm cache's shard keys, every call; a CUDA graph being
        # captured builds its own pack, so that each replay reads the weights as they are then)
        return False
    try:
        key = _key(module, base, adapters, x)
    except RuntimeError:  # a base weight replaced by an inference tensor: no version counter, nothing to key on
        return False
    if key != held.key or global_hooks():
        return False
    same = native_bridge.held_unchanged(held)  # (the passes below in C++: about half their host time)
    if same is None:
        same = (
            all(map(operator.is_, map(dict.get, held.owners, _WEIGHT), held.tensors))
            and tuple(map(_VERSION, held.tensors)) == held.versions
            and tuple(map(_PTR, held.tensors)) == held.ptrs
            and all(map(operator.is_, itertools.starmap(dict.get, held.parents), held.modules))
            and tuple(map(type, held.modules)) == held.types
            and not any(map(operator.contains, held.dicts, _FORWARD))
        )  # fmt: skip
    if (
        not same
        or tuple(map(tuple, held.owners)) != held.keys
        or not all(map(operator.is_, itertools.starmap(dict.get, held.nones), _NONE))
        or any(map(_TRAINING, held.dropouts))
    ):  # fmt: skip
        return False  # (a parameter registered on an adapter's module, a LoRA adapter's dropout in training mode)
    epoch = _hook_epoch()
    if epoch is None or epoch != held.epoch[0]:  # a hook was registered somewhere since the last check
        if hooked(*held.modules) is not None:
            return False
        held.epoch[0] = epoch
    return True


def _pack(module, base, adapters, x, route) -> Pack:
    """The layer's ``Pack`` of ``adapters``: the kept one while ``_unchanged`` holds (what the norm cache keys
    each DoRA adapter's scales on, and every LoRA adapter's weights), else built from the norm cache's scales and
    kept; built inside ``torch.compile`` and CUDA graph capture on every call, kept nowhere."""
    compiling = torch.compiler.is_compiling()
    kept = module.__dict__.get(_PACK)
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
    if not compiling and _keeps(module) and not (x.is_cuda and capturing()):
        held = _held(module, base, adapters, x)
        module.__dict__[_PACK] = None if held is None else pack
        module.__dict__[_HELD] = held
    elif not compiling and not _keeps(module):
        forget(module)  # (the cache off: nothing kept from before is served once it is on again)
    return pack


def forget(module) -> None:
    """Drop the layer's kept pack (``enable`` does, as it clears cached norms)."""
    module.__dict__.pop(_PACK, None)
    module.__dict__.pop(_HELD, None)


def _slots(module, pack: Pack, names, device) -> torch.Tensor:
    """``[B]`` int32: each request's slot in ``pack`` (0: ``"__base__"`` or an adapter this layer does not have).
    Kept on the layer per (adapters, names) list: the same tensor for every call of a ``generate`` and for a CUDA
    graph captured after a first eager call (a list first seen inside capture is filled on the device there)."""
    if torch.compiler.is_compiling():
        return torch.tensor(_slot_values(pack, names), dtype=torch.int32, device=device)
    kept = module.__dict__.get("_flashdora_slots")
    if kept is None:
        kept = module.__dict__["_flashdora_slots"] = {}
    key = (pack.adapters, tuple(names), device)
    slots = kept.get(key)
    if slots is not None:
        return slots
    values = _slot_values(pack, names)
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


def _slot_values(pack: Pack, names) -> list[int]:
    slot_of = {adapter: k for k, adapter in enumerate(pack.adapters, start=1)}
    return [slot_of.get(n, 0) for n in names]
