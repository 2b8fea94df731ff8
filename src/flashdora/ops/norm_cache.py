"""The norm cache: each DoRA layer's ``(norm, scales)`` kept for as long as its weights are unchanged.

The norm never depends on the input, so a layer needs it once per version of its weights: once per optimizer step
in training, once in all at inference. The cache is worth what it saves only if it is never stale, so it trusts
nothing but what PyTorch guarantees (docs/design.md, "The norm cache"). An entry is served only while its key is
equal, the key being, for each of W, A, B and the magnitude:

- the storage's number: a number given to each storage object the first time the cache sees it, never reused. A
  new tensor, ``p.data = ...``, ``.to()``/``.half()``, ``swap_tensors``, ``load_state_dict(assign=True)``, a new
  Parameter, a parametrization's output or ``functional_call``'s tensors are all new storage;
- the version counter, which every in-place write through autograd's view of the tensor moves (``copy_`` in
  ``load_state_dict``, in-place ops under ``no_grad``, loop and foreach optimizers);
- address, shape, strides, dtype and device (views of one storage, storage re-allocated in place);

and the layer's ``scaling`` (PEFT's ``set_scale``, ``scale_layer``), plus two process-wide counters: ``torch.optim``
steps (fused optimizers write without moving version counters) and events that write weights behind the version
counter: ``invalidate()``, PEFT's hotswap and ``load_state_dict`` into an enabled layer. An FSDP2 unsharded
parameter (re-filled in the same storage at every all-gather) is keyed by its shard instead (``_key``). What it
cannot see: a write through an alias that has its own version counter (``p.data.copy_``, numpy or storage aliases,
DLPack), outside the events above; ``flashdora.invalidate()`` after such a write.

``||W||^2`` is kept across optimizer steps, so that a frozen base computes it once: its key holds W's key and the
events, and instead of the step count the last step that may have written W. Each step stamps its number on the
storage of every parameter it may write (those with a gradient or that require one: ``torch.optim`` skips the
others), whatever ``requires_grad`` says later; so freezing, unfreezing and any optimizer in any order never serve a
stale ``||W||^2``. The norm's and the scales' keys hold the step count itself.

No entry holds more than O(d_out) floats; nothing is overwritten in place, so a result handed out stays valid for as
long as anyone holds it. On CUDA an entry is served on other streams only after they wait for it, never inside a
CUDA graph being captured, and nothing is stored while a graph (or cudagraph trees' warm-up) allocates from its
private pool: the rules are in ``ops/cache_streams.py``. Entries live on PEFT's per-adapter magnitude module (the
"owner") and die with it; copies and pickles of a model start empty.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from flashdora import backend, config, dispatch
from flashdora.ops.cache_streams import capturing, in_tree_pool, join, made_on, stream_now
from flashdora.ops.norm import fresh, scales_on, weight_sq
from flashdora.quant.dequant import dequantized

_steps = 0  # torch.optim steps taken in this process
_events = 0  # other writes the version counters miss (module docstring)
_unstamped = 0  # the last step that may have written a parameter whose storage could not be stamped

_storage_numbers = itertools.count(1)


def cache_enabled() -> bool:
    """``config.norm_cache``: ``FLASHDORA_NORM_CACHE`` / ``configure(norm_cache=...)`` (default on)."""
    return config.norm_cache


def bump() -> None:
    """Invalidate every entry in the process (an event the version counters do not see)."""
    global _events
    _events += 1


def invalidate(model: torch.nn.Module | None = None) -> None:
    """Forget cached norms, after writing weights where autograd's version counter does not see it.

    ``p.data.copy_(...)``, writes through numpy or storage aliases, DLPack and other tools that bypass autograd
    change values without a trace; every other route (optimizer steps, in-place ops, ``load_state_dict``, new
    tensors, ``.to()``, PEFT's APIs) is seen by itself. With ``model``, its layers' entries are also freed now;
    every layer in the process recomputes its norm at its next forward either way.
    """
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"invalidate: model expected a torch.nn.Module or None, got {type(model).__name__}")
        for module in model.modules():
            module.__dict__.pop("_flashdora_cache", None)
    bump()


def _count_step(optimizer, args, kwargs) -> None:
    """Count the step, and stamp it on the storage of each parameter it may have written: those with a gradient or
    that require one (fused optimizers write without moving version counters; ``_last_step`` reads the stamp)."""
    global _steps, _unstamped
    _steps += 1
    step = _steps
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None or p.requires_grad:
                try:  # (an FSDP2 parameter is a DTensor: its local shard holds the storage)
                    getattr(p, "_local_tensor", p).untyped_storage()._flashdora_step = step
                except (RuntimeError, NotImplementedError, TypeError):  # no storage: a write to every weight
                    _unstamped = step


_hook_handle = None


def _watch_optimizers() -> None:
    """Count every ``torch.optim`` step in the process (any ``Optimizer`` subclass; fused ones included)."""
    global _hook_handle
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook_handle = register_optimizer_step_post_hook(_count_step)


def _storage_number(t) -> int:
    """A number for ``t``'s storage, never given to another storage in this process.

    torch keeps one Python object per live storage, attributes included, so the number lives exactly as long as the
    storage; a new storage at an old address gets a new number.
    """
    s = t.untyped_storage()
    n = getattr(s, "_flashdora_number", None)
    if n is None:
        n = s._flashdora_number = next(_storage_numbers)
    return n


def _last_step(t) -> int:
    """The last optimizer step that may have written ``t``'s values (``_count_step``; an FSDP2 parameter's: its
    shard's), 0 if none has.

    Optimizer wrappers step a parameter below autograd, unseen by the stamps: DeepSpeed's ZeRO optimizers step their
    own fp32 copy and copy the values back through ``.data``, and keep doing so for a parameter frozen after
    ``deepspeed.initialize``. Such a parameter is marked by the gradient hook the wrapper registers on it
    (``register_post_accumulate_grad_hook``, kept until the wrapper is destroyed). So a tensor that requires a
    gradient, carries such a hook, or once required a gradient as a ZeRO-3 parameter, may have been written by the
    last step of any optimizer. A ZeRO-3 parameter's gathered storage is new at every gather: it holds no stamp."""
    p = _zero3_param(t)
    if p is not None:
        if p.requires_grad:
            p._flashdora_trained = True
        stepped = getattr(p, "_flashdora_trained", False) or _wrapper_held(p)
        return _steps if stepped else _unstamped
    if t.requires_grad or _wrapper_held(t if t._base is None else t._base):
        return _steps
    tag = getattr(t, "_flashdora_shard", None) or getattr(t._base, "_flashdora_shard", None)  # (``_key``)
    storage = (t if tag is None else tag[1]).untyped_storage()
    return max(getattr(storage, "_flashdora_step", 0), _unstamped)


_HOOKS_READABLE = hasattr(torch.Tensor, "_post_accumulate_grad_hooks")  # (private; in every torch since 2.1)


def _wrapper_held(p) -> bool:
    """Whether ``p`` carries a post-accumulate-grad hook (``_last_step``): an optimizer wrapper's, such as DeepSpeed
    ZeRO's, or an optimizer step in the backward. Where torch keeps them elsewhere: always."""
    return not _HOOKS_READABLE or bool(p._post_accumulate_grad_hooks)


def _key(t) -> tuple | None:
    """``t``'s ``(address, shape, strides, dtype, device, storage number, version)``; for an FSDP2 unsharded parameter
    (tagged by ``watch.shards``), its shard's address, storage number and versions instead of its own address: FSDP2
    re-fills it without moving its version. ``None`` when its values are older than its shard (FSDP2 has not
    re-gathered since the shard changed): nothing to key an entry on. Raises ``RuntimeError`` for tensors without a
    version counter (inference tensors)."""
    tag = getattr(t, "_flashdora_shard", None)
    if tag is None:
        base = t._base  # ``weight.T`` (``fan_in_fan_out``) and other views of a tagged parameter
        tag = None if base is None else getattr(base, "_flashdora_shard", None)
        if tag is None:
            return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, _storage_number(t), t._version)
    shard, local, shard_version, local_version = tag
    if shard._version != shard_version or local._version != local_version:
        return None
    n = _storage_number
    return ("shard", local.data_ptr(), n(local), shard_version, local_version, t.shape, t.stride(), t.storage_offset(),
            t.dtype, t.device, n(t), t._version)  # fmt: skip


def _zero3_param(t):
    """``t`` if it is a DeepSpeed ZeRO-3 parameter, else ``None``: its ``ds_tensor`` is the rank's partition, which
    outlives every gather. (No view of one gets here: a ``Conv1D`` base's ``weight.T`` runs PEFT's forward.)"""
    return t if "ds_tensor" in getattr(t, "__dict__", ()) else None


def _base_sq_key(weight, w_key) -> tuple:
    """The key of ``weight``'s ``||W||^2``: its own key (``_key``), or for a ZeRO-3 parameter its partition's.

    DeepSpeed gathers a ZeRO-3 parameter into a new buffer at every gather (forward, backward, recomputation), so
    its own key changes at each; its values are those of the ranks' partitions. This rank's partition
    (``ds_tensor``) is kept across gathers: its storage number and version (``GatheredParameters``'s write-back
    copies into it in place) and the parameter's own version (an in-place write through the gathered parameter)
    stand for the gathered values; optimizer steps are ``_last_step``'s."""
    p = _zero3_param(weight)
    part = None if p is None else p.ds_tensor
    if part is None or getattr(p, "ds_status", None) is None:
        return w_key
    return ("zero3", p.ds_id, part.data_ptr(), _storage_number(part), part._version, p._version, weight.shape,
            weight.stride(), weight.dtype, weight.device)  # fmt: skip


def _keys(w, a, b, m) -> tuple:
    """The four tensors' keys (``_key``), in one call (this runs on every layer call)."""
    return _key(w), _key(a), _key(b), _key(m)


class _Entries(dict):
    """One layer's entries. Copies and pickles of a model start empty: the keys describe this model's storage."""

    def __deepcopy__(self, memo):
        return _Entries()

    def __reduce__(self):
        return _Entries, ()


_set_grad_enabled = torch._C._set_grad_enabled


def _uncached(weight, lora_A, lora_B, magnitude, scaling, quantized=None, dtype=None, impl=None) -> torch.Tensor:
    """The scales computed now, kept nowhere (no cache, meta tensors, inference tensors)."""
    impl = impl or dispatch.norm_impl(weight, lora_A, lora_B, magnitude, quantized is not None)
    if quantized is not None:
        weight = dequantized(quantized, weight, dtype, dispatch.dequantizer(impl == "native"))
    return fresh(weight, lora_A, lora_B, magnitude, scaling, impl)[1]


class NormCache:
    """Per-layer entries, O(d_out): the norm, ``||W||^2`` and the scales, each with the key it was made for.

    Entries live on an owner object (PEFT's per-adapter magnitude module) and die with it; the compiled path finds
    them by ``id(owner)`` (``register``).
    """

    _owners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    @classmethod
    def register(cls, owner) -> int:
        _watch_optimizers()
        cls._owners[id(owner)] = owner
        return id(owner)

    @classmethod
    def lookup(cls, weight, lora_A, lora_B, magnitude, scaling: float, cache_id: int, impl=None) -> torch.Tensor:
        """``scales(magnitude, norm)`` for this layer, recomputing only what its weights' versions invalidate; as the
        compiled op calls it (nothing stored during a cudagraph trees warm-up: ``cache_streams``)."""
        owner = cls._owners.get(cache_id) if cache_id >= 0 else None
        return cls.lookup_owner(weight, lora_A, lora_B, magnitude, scaling, owner, compiled=True, impl=impl)

    @classmethod
    def register_layer(cls, owner, layer) -> None:
        """Tell ``owner``'s entries their LoRA layer: a compiled call hands the cache a detached alias of the base
        weight, without the ``requires_grad`` and hooks that say which steps may write it (``_last_step``)."""
        owner.__dict__["_flashdora_layer"] = _LayerRef(layer)

    @classmethod
    def lookup_owner(
        cls, weight, lora_A, lora_B, magnitude, scaling: float, owner,
        quantized=None, dtype=None, compiled=False, impl=None,
    ) -> torch.Tensor:  # fmt: skip
        """``lookup`` by the owner object itself (``None``: no cache), as eager calls hold it.

        ``quantized``: a bitsandbytes base layer; ``weight`` is then its packed tensor, which the key is made of. A
        miss dequantizes it to the 16-bit weight the layer's own forward computes with (bitsandbytes' kernels), runs
        the 16-bit norm on it and frees it. ``dtype``: the layer input's dtype, which an 8-bit weight is dequantized to
        (as PEFT's DoRA casts it). ``impl``: what a miss runs (the route's ``norm``; ``None``: routed here)."""
        if impl is None:
            impl = dispatch.norm_impl(weight, lora_A, lora_B, magnitude, quantized is not None)
        if owner is None or weight.is_meta or not cache_enabled():
            return _uncached(weight, lora_A, lora_B, magnitude, scaling, quantized, dtype, impl)
        try:
            keys = _keys(weight, lora_A, lora_B, magnitude)
        except RuntimeError:  # inference tensors have no version counter: nothing to key an entry on
            return _uncached(weight, lora_A, lora_B, magnitude, scaling, quantized, dtype, impl)
        if None in keys:  # an FSDP2 parameter gathered before its shard's last write
            return _uncached(weight, lora_A, lora_B, magnitude, scaling, quantized, dtype, impl)
        w_key, a_key, b_key, m_key = keys
        cache = owner.__dict__.get("_flashdora_cache")
        if cache is None:
            cache = owner.__dict__["_flashdora_cache"] = _Entries()
        key = (w_key, a_key, b_key, scaling, _steps, _events)
        full_key = (key, m_key)
        if cache.get("scales_key") == full_key and (cache["streams"] is None or _usable(cache)):
            backend.count("norm:cached")
            return cache["scales"]
        if weight.is_cuda and (in_tree_pool(weight.get_device()) if compiled else capturing()):
            # inside a CUDA graph (or allocating to its pool): computed where it runs, kept nowhere (cache_streams)
            return _uncached(weight, lora_A, lora_B, magnitude, scaling, quantized, dtype, impl)
        if cache.get("streams") is not None:
            _usable(cache)  # a miss may reuse the entry's ||W||^2 or norm
        # Entries are made outside autograd (the inputs may be parameters) and outside inference mode (an inference
        # tensor kept here could not be saved for a later training step's backward).
        grad = torch.is_grad_enabled()
        _set_grad_enabled(False)
        try:
            stepped = _own_weight(owner, weight) if compiled else weight
            args = (cache, key, full_key, weight, lora_A, lora_B, magnitude, scaling, quantized, dtype, impl, stepped)
            if torch.is_inference_mode_enabled():
                with torch.inference_mode(False):
                    return _update(*args)
            return _update(*args)
        finally:
            _set_grad_enabled(grad)

    @staticmethod
    def clear(owner) -> None:
        owner.__dict__.pop("_flashdora_cache", None)


def _usable(cache) -> bool:
    """Whether a CUDA entry may be used on the current stream (not while a graph is captured), after making that
    stream wait for the entry where it was made on another one (``cache_streams``)."""
    if capturing():
        return False
    streams, device = cache["streams"], cache["device"]
    if stream_now(device) not in streams:
        join(device, streams, [cache[name] for name in ("w_sq", "norm", "scales") if name in cache])
    return True


class _LayerRef:
    """A weak reference to an owner's LoRA layer. Copies and pickles of a model hold none (``enable`` gives them
    theirs): a copy's owner belongs to another layer."""

    __slots__ = ("ref",)

    def __init__(self, layer=None):
        self.ref = None if layer is None else weakref.ref(layer)

    def __call__(self):
        return None if self.ref is None else self.ref()

    def __deepcopy__(self, memo):
        return _LayerRef()

    def __reduce__(self):
        return _LayerRef, ()


def _own_weight(owner, weight):
    """The base layer's weight parameter that ``weight`` (a compiled call's detached alias) is, else ``None``."""
    ref = owner.__dict__.get("_flashdora_layer")
    layer = None if ref is None else ref()
    own = None if layer is None else getattr(layer.get_base_layer(), "weight", None)
    if own is None or own.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr():
        return None
    return own


def _update(
    cache, key, full_key, weight, lora_A, lora_B, magnitude, scaling, quantized=None, dtype=None, impl="eager",
    stepped=None,
) -> torch.Tensor:  # fmt: skip
    """A miss: what changed, computed again. ``stepped``: the tensor whose last step (``_last_step``) keys
    ``||W||^2`` (``None``: unknown, any step may have written W)."""
    if cache.get("norm_key") == key:  # only the magnitude moved
        backend.count("norm:cached")
        cache["scales"] = scales_on(magnitude, cache["norm"], impl != "eager")
    else:
        # ||W||^2 once per version of W: a frozen base's survives optimizer steps that did not touch it
        w_key = (_base_sq_key(weight, key[0]), _events, _steps if stepped is None else _last_step(stepped))
        new_sq = cache.get("w_sq_key") != w_key
        if quantized is not None:
            # the 16-bit weight the forward computes with, freed after
            weight = dequantized(quantized, weight, dtype, dispatch.dequantizer(impl == "native"))
        if new_sq:
            backend.count("norm:base_sq")
            cache["w_sq"], cache["w_sq_key"] = weight_sq(weight, impl != "eager"), w_key
        cache["norm"], cache["scales"] = fresh(weight, lora_A, lora_B, magnitude, scaling, impl, cache["w_sq"])
        cache["norm_key"] = key
    cache["device"], cache["streams"] = made_on(magnitude)  # (before the key that lets a hit read them)
    cache["scales_key"] = full_key
    return cache["scales"]


@torch.library.custom_op("flashdora::dora_scales", mutates_args=())
def dora_scales_op(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, magnitude: torch.Tensor, scaling: float,
    cache_id: int,
) -> torch.Tensor:  # fmt: skip
    """``scales(magnitude, ||W + s B A||_row)``, from the layer's cache when ``cache_id`` names a registered owner."""
    return NormCache.lookup(weight, lora_A, lora_B, magnitude, scaling, cache_id).clone()  # no alias of the cache


@dora_scales_op.register_fake
def _(weight, lora_A, lora_B, magnitude, scaling, cache_id):
    return magnitude.new_empty((3, weight.shape[0]), dtype=torch.promote_types(magnitude.dtype, torch.float32))


def dora_scales(weight, lora_A, lora_B, magnitude, scaling: float, cache_id: int = -1) -> torch.Tensor:
    """The ``[3, d_out]`` scales ``(g, g - 1, 1 / norm)`` of a DoRA layer (detached; see ``ops.norm.scales``).

    Eager calls go straight to the cache (no op-dispatch overhead); under ``torch.compile`` the custom op keeps
    the cache lookup at run time, opaque to the graph.
    """
    if torch.compiler.is_compiling():
        return dora_scales_op(weight.detach(), lora_A.detach(), lora_B.detach(), magnitude.detach(), scaling, cache_id)
    return NormCache.lookup(weight, lora_A, lora_B, magnitude, scaling, cache_id)  # no_grad inside where it computes
