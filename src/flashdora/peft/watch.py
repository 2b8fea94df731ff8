"""The hooks by which the norm cache sees writes that no version counter shows (``ops/norm_cache.py``).

Most call ``norm_cache.bump()``: every layer recomputes its norm at its next forward. ``enable`` installs the
per-model ones; PEFT's hotswap functions are wrapped once, when flashdora's PEFT seam is imported. Under FSDP2 the
unsharded parameters are keyed by their shards instead (``watch_fsdp``).
"""

from __future__ import annotations

import functools

import torch
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from flashdora.ops import norm_cache
from flashdora.peft.support import base_layer


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


def watch_writes(model: nn.Module, on: bool) -> None:
    """Install (``on``) or remove the ``load_state_dict`` post-hook on every LoRA layer of ``model``: under FSDP2 the
    values land in the sharded parameters, whose version counters the unsharded ones do not share."""
    for module in model.modules():
        for handle in module.__dict__.pop("_flashdora_hooks", ()):
            handle.remove()
        if on and isinstance(module, LoraLayer):
            module.__dict__["_flashdora_hooks"] = [module.register_load_state_dict_post_hook(_loaded)]


# FSDP2. At every all-gather FSDP2 re-fills the same unsharded parameter (one persistent ``nn.Parameter`` per sharded
# one, its storage freed and re-allocated) without moving its version counter, so its address and version say
# nothing about its values. Its values are those of the sharded parameter (a DTensor), whose version counters (its
# own, and its local tensor's for writes through ``to_local()``) do move with every write: optimizer steps, in-place
# edits, loads. So the cache keys an unsharded parameter by its shard:
# a forward pre-hook that runs before FSDP2's own (a global one: those run first) takes the sharded parameters of
# the LoRA layers each FSDP2 module manages, and the layer's next forward (after FSDP2's all-gather) tags each
# unsharded parameter with its shard (``_flashdora_shard``). The norm is then computed once per weight version, as
# on one GPU, whether FSDP2 re-gathers for the forward, for the backward or for a checkpoint's recomputation.

fsdp_hook = None


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


def watch_fsdp() -> None:
    """Install the global forward pre-hook that tags FSDP2's unsharded parameters (once; a no-op while no process
    group is initialized: FSDP2 needs one, and a process without it pays nothing)."""
    global fsdp_hook
    if fsdp_hook is not None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    fsdp = _fsdp_module_class()
    if fsdp is None:
        return
    from torch.distributed.tensor import DTensor

    def before_fsdp(module, args):
        if isinstance(module, fsdp):
            _take_shards(module, fsdp, DTensor)

    before_fsdp._flashdora_own = True  # (not a user's hook: layers.global_hooks skips it)
    fsdp_hook = nn.modules.module.register_module_forward_pre_hook(before_fsdp)


def _managed_lora_layers(root, fsdp):
    """The LoRA layers whose parameters FSDP2 module ``root`` gathers (nested FSDP2 modules gather their own)."""
    stack = list(root._modules.values())
    while stack:
        module = stack.pop()
        if module is None or isinstance(module, fsdp):
            continue
        if isinstance(module, LoraLayer):
            yield module
        stack.extend(module._modules.values())
    if isinstance(root, LoraLayer):
        yield root


def _owners(layer):
    """The modules holding the four tensors the norm cache keys a DoRA layer by: base, lora_A, lora_B, magnitude
    (read from the modules' own dicts: this runs at every gather)."""
    mods = [base_layer(layer)]
    sub = layer._modules
    magnitudes, a_layers, b_layers = sub.get("lora_magnitude_vector"), sub.get("lora_A"), sub.get("lora_B")
    if magnitudes is None or a_layers is None or b_layers is None:
        return mods
    a_layers, b_layers = a_layers._modules, b_layers._modules
    for name, magnitude in magnitudes._modules.items():
        if name in a_layers and name in b_layers:  # (DoRA Embedding layers keep theirs elsewhere: PEFT's code)
            mods += [a_layers[name], b_layers[name], magnitude]
    return mods


def _take_shards(module, fsdp, dtensor) -> None:
    """Before FSDP2 gathers ``module``: note each managed LoRA layer's sharded weights (a module already gathered, as
    in a checkpoint's recomputation, keeps the tags its gathered parameters carry)."""
    for layer in _managed_lora_layers(module, fsdp):
        pending = [(m, p) for m in _owners(layer) if isinstance(p := m._parameters.get("weight"), dtensor)]
        if pending:
            layer.__dict__["_flashdora_pending"] = pending


def shards(layer) -> None:
    """At a LoRA layer's forward (FSDP2 has gathered): tag each unsharded weight with its shard, the shard's local
    tensor and both their versions now (``norm_cache._key``)."""
    pending = layer.__dict__.pop("_flashdora_pending", None)
    if pending is None:
        return
    with torch.no_grad():
        for owner, sharded in pending:
            gathered = owner._parameters.get("weight")
            if gathered is not None and gathered is not sharded:
                # The versions its values were gathered at: the DTensor's (in-place ops through it, optimizer steps,
                # loads: DTensor runs the op on its local tensor below autograd, where that one's counter stays) and
                # its local tensor's (writes through ``to_local()``).
                local = sharded.to_local()
                gathered._flashdora_shard = (sharded, local, sharded._version, local._version)


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
