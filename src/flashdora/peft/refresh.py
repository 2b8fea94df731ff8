"""A trained DoRA layer's norm made right after the optimizer step instead of in its next forward.

In training every layer's weights change at each optimizer step, so each layer's next forward misses the norm cache
(docs/design.md, "The norm cache"): keys, a cast, two GEMMs and two kernels, once per layer and step. At one sequence
the forward is where the host paces the GPU, while right after the step the GPU is still running the backward's last
kernels and the optimizer's. So an enabled layer whose forward missed while its magnitude trains is noted here
(``on_miss``), and after each later ``torch.optim`` step outside a backward (``after_step``, called by the cache's
step hook once the step is counted), each noted layer with a tensor that optimizer holds gets its entry made then:
the same lookup its forward makes, on the same tensors, keyed on them as they are at that moment. The key decides,
as for every entry: a refresh is never served stale, only wasted, when something moves its key before a forward
reads it (another optimizer's step: every step counts for every trainable tensor; a load; a forward that never
comes; ``norm:refresh_wasted``). A layer whose refreshes were wasted ``SPARE`` times more than read is dropped for
the rest of the process: its forwards then miss as before.

Not noted: bitsandbytes bases (a refresh would hold a dequantized weight), processes with a process group (FSDP2 frees
the gathered weights after the backward; DDP, DeepSpeed), compiled and CUDA-graph calls, models switched by
``patch_peft`` without ``enable`` (no layer to read the tensors from). Where torch's backward task id is not readable
(``config.private`` off), nothing is refreshed: a step inside a backward (optimizer-in-backward loops) cannot be told.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from flashdora import backend, config
from flashdora.ops import norm_cache
from flashdora.peft.layers import plain_active
from flashdora.peft.support import base_layer, param

ENABLED = True  # (``flashdora bench model``'s ``flashdora_norefresh`` mode turns it off)
_noted: dict[int, tuple] = {}  # id(owner) -> (owner ref, layer ref, adapter, impl)
_dropped: weakref.WeakSet = weakref.WeakSet()  # owners whose refreshes were wasted more often than read
SPARE = 2  # wasted refreshes a layer may have beyond those read
_graph_task = getattr(torch._C, "_current_graph_task_id", None)  # private: read where ``config.private``
_PLAIN = (torch.Tensor, nn.Parameter)
_failed = False  # a refresh raised: none from then on


def on_miss(owner, cache: dict, impl: str | None, quantized) -> None:
    """A miss on ``owner``'s entries while its magnitude trains (the norm cache, before it recomputes ``cache``; the
    call may run without grad: reentrant checkpointing's first forward does)."""
    if cache.pop("refreshed", False):  # made after the last step, never read: the refresh was wasted
        _wasted(owner, cache)
        return
    if not ENABLED or _failed or quantized is not None or id(owner) in _noted or owner in _dropped:
        return
    ref = owner.__dict__.get("_flashdora_layer")
    layer = None if ref is None else ref()
    if layer is None or _graph_task is None or not config.private or _distributed():
        return
    adapter = next((name for name, m in layer.lora_magnitude_vector.items() if m is owner), None)
    if adapter is not None:
        _noted[id(owner)] = (weakref.ref(owner), weakref.ref(layer), adapter, impl)


def after_step(optimizer) -> None:
    """Refresh the noted layers whose magnitude ``optimizer`` (just stepped and counted) holds."""
    if not _noted or not ENABLED or not config.private or _graph_task() != -1:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    try:
        for key, (owner_ref, layer_ref, adapter, impl) in list(_noted.items()):
            owner, layer = owner_ref(), layer_ref()
            if owner is None or layer is None:
                del _noted[key]
                continue
            magnitude = owner._parameters.get("weight")  # (first: another model's optimizer costs a lookup a layer)
            cache = owner.__dict__.get("_flashdora_cache")
            if id(magnitude) in held and cache is not None:
                _refresh(layer, adapter, owner, magnitude, cache, impl)
    except Exception as e:  # noqa: BLE001 - the forward computes what a refresh could not
        global _failed
        _failed = True
        _noted.clear()
        backend.warn_once(
            "refresh", f"flashdora: norms are computed in the forward from now on ({type(e).__name__}: {e})"
        )


def _refresh(layer, adapter: str, owner, magnitude, cache: dict, impl) -> None:
    """``owner``'s entry made now, where the layer's next plain call will run ``adapter`` in training."""
    if not layer.training or plain_active(layer, (), {}) != adapter:
        return
    mods = layer._modules
    weight = param(base_layer(layer), "weight")
    if type(weight) not in _PLAIN:
        return
    lora_A = param(mods["lora_A"]._modules[adapter], "weight")
    lora_B = param(mods["lora_B"]._modules[adapter], "weight")
    if cache.pop("refreshed", False):  # the last refresh was never read
        if _wasted(owner, cache):
            return
    weight = weight.T if layer.fan_in_fan_out else weight
    before = cache.get("scales_key")
    scaling = float(layer.scaling[adapter])
    norm_cache.NormCache.lookup_owner(weight, lora_A, lora_B, magnitude, scaling, owner, impl=impl)
    if cache.get("scales_key") != before:
        cache["refreshed"] = True
        backend.count("norm:refreshed")


def _wasted(owner, cache: dict) -> bool:
    """Count a wasted refresh; whether it dropped ``owner`` (wasted ``SPARE`` more times than read)."""
    backend.count("norm:refresh_wasted")
    cache["wasted"] = wasted = cache.get("wasted", 0) + 1
    if wasted <= cache.get("reads", 0) + SPARE:
        return False
    _noted.pop(id(owner), None)
    _dropped.add(owner)
    return True


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def forget() -> None:
    """Nothing noted, nothing dropped (tests)."""
    global _failed
    _failed = False
    _noted.clear()
    _dropped.clear()


norm_cache._on_miss, norm_cache._after_step = on_miss, after_step
