"""The PEFT seam's switches: ``enable``/``disable`` per model, ``patch_peft``/``unpatch_peft`` per process.

PEFT keeps one variant object per (layer, adapter) in ``module.lora_variant``. Its class (``peft.variant``) decides
the path:

- ``FlashDoraLinearVariant`` (set by ``enable``): flashdora, always.
- ``PeftDoraLinearVariant`` (set by ``disable``): PEFT's own DoRA, always.
- PEFT's ``DoraLinearVariant`` (what PEFT creates): follows the process-wide ``patch_peft`` switch.

``enable`` also re-classes PEFT's LoRA ``Linear`` layers (and its ``lora.bnb`` ones) as flashdora's
(``peft.layers``), whose forward skips PEFT's per-call dispatch on the plain calls that flashdora runs (``disable``
restores the class). Merge, unmerge, save and load stay
PEFT's (only forwards are replaced), so checkpoints keep PEFT's format. Cases we do not handle run PEFT's code with
a one-time warning and a ``peft_fallback:<reason>`` counter.
"""

from __future__ import annotations

from peft.tuners.lora import variants
from peft.tuners.lora.layer import Linear as PeftLinear
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from flashdora import backend, config, dispatch
from flashdora.ops.norm_cache import NormCache
from flashdora.peft import layers as peft_layers
from flashdora.peft import mixed, mixed_hooks, variant, watch
from flashdora.peft.enable_check import warn_if_nothing_to_enable
from flashdora.peft.support import unsupported_reason
from flashdora.peft.variant import (
    _FLASH_STATIC,
    _PEFT_DORA,
    _PEFT_FORWARD,
    DROPOUT_MODES,
    FlashDoraLinearVariant,
    PeftDoraLinearVariant,
    is_patched,
)
from flashdora.peft.watch import watch_writes

# DoRA variants of layer types flashdora does not handle: their PEFT forward runs, counted under this reason.
_OTHER_DORA = {
    variants.DoraEmbeddingVariant: "embedding",
    variants.DoraConv1dVariant: "conv",
    variants.DoraConv2dVariant: "conv",
    variants.DoraConv3dVariant: "conv",
}


def _make_counting(cls: type) -> type:
    """A subclass of a PEFT DoRA variant that counts and warns (once) before running PEFT's forward. Defined at import
    under a module-level name, so that a model holding one pickles (``torch.save``) and unpickles in a new process."""
    reason, peft_forward = _OTHER_DORA[cls], cls.forward

    def forward(module, active_adapter, x, *args, **kwargs):
        backend.count(f"peft_fallback:{reason}")
        backend.warn_once(f"fallback:{reason}", f"flashdora: DoRA {reason} layers run PEFT's own code")
        return peft_forward(module, active_adapter, x, *args, **kwargs)

    name = f"FlashDoraCounting{cls.__name__}"
    counting = type(name, (cls,), {"forward": staticmethod(forward), "__module__": __name__, "__qualname__": name})
    globals()[name] = counting
    return counting


_counting_classes: dict[type, type] = {cls: _make_counting(cls) for cls in _OTHER_DORA}


def _counting(cls: type) -> type:
    return _counting_classes[cls]


def _swap_variants(model: nn.Module, linear_cls: type, norm_cache: bool = True) -> int:
    """Give every DoRA variant of ``model`` the class for the wanted state (and a fresh norm cache).

    Returns how many Linear variants changed class.
    """
    changed = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        mixed.forget(module)  # (a mixed-batch pack: its scales are cached norms)
        for owner in module.lora_magnitude_vector.values():
            NormCache.clear(owner)
            owner._flashdora_cache_id = NormCache.register(owner) if norm_cache else -1
            NormCache.register_layer(owner, module)
        for adapter, held in list(module.lora_variant.items()):
            kind = type(held)
            if kind in (_PEFT_DORA, FlashDoraLinearVariant, PeftDoraLinearVariant):
                changed += kind is not linear_cls
                module.lora_variant[adapter] = held if kind is linear_cls else linear_cls()
            elif kind in _OTHER_DORA and linear_cls is FlashDoraLinearVariant:
                module.lora_variant[adapter] = _counting(kind)()
            elif kind in _counting_classes.values() and linear_cls is not FlashDoraLinearVariant:
                module.lora_variant[adapter] = kind.__mro__[1]()
    return changed


def _dropout_mode(fn: str, dropout) -> str:
    if dropout not in DROPOUT_MODES:
        raise ValueError(f"{fn}: dropout expected one of {', '.join(map(repr, DROPOUT_MODES))}, got {dropout!r}")
    return dropout


def enable(model: nn.Module, *, norm_cache: bool = True, dropout: str = "exact") -> nn.Module:
    """Run every DoRA Linear layer (``nn.Linear``, ``Conv1D``) of a PEFT ``model`` through flashdora.

    Idempotent; returns ``model``. Adapters added later are PEFT's until ``enable`` is called again (or use
    ``patch_peft``). DoRA Embedding and Conv layers keep PEFT's code, counted as ``peft_fallback:<kind>``.

    Args:
        model: a PEFT model (or any module holding PEFT LoRA layers).
        norm_cache: keep each layer's norm until its weights change (default; ``FLASHDORA_NORM_CACHE=0`` turns it
            off process-wide). Calling ``enable`` again clears the cache, e.g. after writing weights via ``.data``.
        dropout: what ``lora_dropout`` drops in training. ``"exact"`` (default): PEFT's function,
            ``y = x W^T + b + (g - 1) (lora_x W^T) + g s (lora_x A^T) B^T`` with ``lora_x = dropout(x)`` (one more
            base-sized matmul forward and backward). ``"adapter"``: dropout on the low-rank branch only,
            ``y = g (x W^T + s (lora_x A^T) B^T) + b``, at the cost of a layer without dropout: a slightly
            different function in training (README, "Dropout"); eval, checkpoints and merging are PEFT's either way.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable: model expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(norm_cache, bool):
        raise TypeError(f"enable: norm_cache expected a bool, got {type(norm_cache).__name__}")
    _dropout_mode("enable", dropout)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.__dict__["_flashdora_dropout"] = dropout
            module.__dict__["_flashdora_norm_cache"] = norm_cache  # (a mixed batch keeps a pack only where on)
    _swap_variants(model, FlashDoraLinearVariant, norm_cache)
    peft_layers.swap_linear_class(model, config.peft_tested())  # (PEFT's private surface: tested versions only)
    mixed_hooks.install(model)  # (adapter_names without PEFT's per-call module walks)
    watch_writes(model, True)
    watch.watch_fsdp()
    warn_if_nothing_to_enable(model)  # one UserWarning naming what it found when no layer has use_dora=True
    return model


def disable(model: nn.Module) -> nn.Module:
    """Put every DoRA layer of ``model`` back on PEFT's own forward, even while ``patch_peft`` is on. Idempotent."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"disable: model expected a torch.nn.Module, got {type(model).__name__}")
    _swap_variants(model, PeftDoraLinearVariant)
    peft_layers.swap_linear_class(model, False)
    mixed_hooks.uninstall(model)
    watch_writes(model, False)
    for module in model.modules():
        module.__dict__.pop("_flashdora_dropout", None)
        module.__dict__.pop("_flashdora_norm_cache", None)
    return model


def patch_peft(*, dropout: str = "exact") -> None:
    """Process-wide: every PEFT DoRA Linear layer, existing or created later, runs flashdora (PEFT's ``Linear``
    takes ``FlashDoraLinear``'s forward). Idempotent.

    Layers switched with ``disable(model)`` stay on PEFT; layers of an ``enable``d model keep ``enable``'s dropout
    mode. ``dropout``: as ``enable``'s, for every other layer. Undo with ``unpatch_peft()``.
    """
    variant._patch_dropout = _dropout_mode("patch_peft", dropout)
    _PEFT_DORA.forward = _FLASH_STATIC
    if config.peft_tested():  # (PEFT's private surface: tested versions only; elsewhere its layers call the variant)
        PeftLinear.forward = peft_layers.lean_forward
        PeftLinear._cast_input_dtype = peft_layers.cast_input_dtype
        peft_layers.patch_bnb(True)
    for cls in _OTHER_DORA:
        if "_flashdora_peft_forward" not in cls.__dict__:
            counting = _counting(cls)  # captures PEFT's forward before it is replaced
            cls._flashdora_peft_forward = cls.__dict__.get("forward")  # None: inherited from a parent class
            cls.forward = counting.__dict__["forward"]


def unpatch_peft() -> None:
    """Undo ``patch_peft``: PEFT's DoRA layers run PEFT's own code again (``enable``d models stay on). Idempotent."""
    variant._patch_dropout = "exact"
    _PEFT_DORA.forward = _PEFT_FORWARD
    PeftLinear.forward = peft_layers._PEFT_LINEAR_FORWARD
    if PeftLinear.__dict__.get("_cast_input_dtype") is peft_layers.cast_input_dtype:
        del PeftLinear._cast_input_dtype  # LoraLayer's, inherited, again
    peft_layers.patch_bnb(False)
    for cls in _OTHER_DORA:
        if "_flashdora_peft_forward" in cls.__dict__:
            original = cls.__dict__["_flashdora_peft_forward"]
            if original is None:
                del cls.forward
            else:
                cls.forward = original
            del cls._flashdora_peft_forward


def layer_path(module: LoraLayer, adapter: str) -> str:
    """The path a DoRA adapter of ``module`` takes: ``flashdora:<compose>`` (the compose of the route its last call
    took, ``dispatch``; ``flashdora:not run`` before any call), ``peft`` or ``peft:<reason>``."""
    kind = type(module.lora_variant.get(adapter))
    if kind in _OTHER_DORA or kind in _counting_classes.values():
        return f"peft:{_OTHER_DORA.get(kind) or _OTHER_DORA[kind.__mro__[1]]}"
    if kind is PeftDoraLinearVariant or (kind is _PEFT_DORA and not is_patched()):
        return "peft"
    reason = unsupported_reason(module, adapter)
    if reason is not None:
        return f"peft:{reason}"
    route = dispatch.last_route(module, adapter)
    if route is None:
        return "flashdora:not run"
    return f"peft:{route.why}" if route.compose == "peft" else f"flashdora:{route.compose}"
