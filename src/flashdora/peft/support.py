"""Which DoRA Linear layers flashdora runs, and why not the others (``unsupported_reason``), plus the accessors the
per-call forward uses: submodules and parameters read from the modules' own dicts."""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import LoraLayer
from torch import nn
from transformers.pytorch_utils import Conv1D

from flashdora import config
from flashdora.quant.dequant import dequantized  # noqa: F401 (peft.variant imports it from here)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def unsupported_reason(module: LoraLayer, adapter: str) -> str | None:
    """Why flashdora cannot run this DoRA Linear layer (``None`` when it can)."""
    mods = module._modules
    base = base_layer(module)
    lora_B_layer = mods["lora_B"]._modules[adapter]
    why = reason(
        base, param(base, "weight"), param(mods["lora_A"]._modules[adapter], "weight"), lora_B_layer,
        param(lora_B_layer, "weight"), param(mods["lora_magnitude_vector"]._modules[adapter], "weight"), at_rest=True,
    )  # fmt: skip
    why = why or params_reason(mods, adapter)
    hook = None if why is not None else hooked_adapter(module, adapter)  # (flash_forward's order: its answer)
    return why if hook is None else f"hooks:{hook}"


_MODULE_DICTS = ("lora_A", "lora_B", "lora_magnitude_vector")


def params_reason(mods, adapter) -> str | None:
    """A parameter other than ``weight`` on an adapter's A, B or magnitude module (a bias PEFT's module call adds;
    the fused compose reads ``weight`` only): ``params:<dict>.<name>`` (``lora_B``'s bias: ``lora_bias``)."""
    for name in _MODULE_DICTS:
        layer = mods[name]._modules.get(adapter)
        for key, value in ({} if layer is None else layer._parameters).items():
            if key != "weight" and value is not None:
                return "lora_bias" if (name, key) == ("lora_B", "bias") else f"params:{name}.{key}"
    return None


# The forward runs once per layer call, where host time is the bottleneck: it reads submodules and parameters from
# the modules' own dicts, not through ``nn.Module.__getattr__`` or PEFT's ``get_base_layer`` (docs/host-notes.md).


def base_layer(module: nn.Module) -> nn.Module:
    """PEFT's ``get_base_layer``: the innermost ``base_layer`` (nested when LoRA layers wrap LoRA layers)."""
    while "base_layer" in module._modules:
        module = module._modules["base_layer"]
    return module


def param(module: nn.Module, name: str):
    """``getattr(module, name)`` for a registered parameter, without ``nn.Module.__getattr__``."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name, None)


# Process-wide module hooks (``register_module_forward_hook`` and its kind) live in private dicts of
# ``torch.nn.modules.module``, present in every torch the tests cover; where one is missing, "maybe": every call
# then runs PEFT's own forward.
_GLOBAL_HOOKS = tuple(
    getattr(nn.modules.module, name, {None: None})
    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
)  # fmt: skip
_PLAIN_FORWARDS = {nn.Linear.forward}


def global_hooks() -> bool:
    """Whether a process-wide module hook is registered, other than flashdora's own (``watch``'s FSDP2 pre-hook,
    marked ``_flashdora_own``: it needs no adapter module called)."""
    forward, pre, backward, backward_pre = _GLOBAL_HOOKS
    if pre and not all(getattr(hook, "_flashdora_own", False) for hook in pre.values()):
        return True
    return bool(forward or backward or backward_pre)


def _called_differently(module: nn.Module) -> bool:
    """Whether calling ``module`` runs more than its class's forward: a forward, pre-forward or backward hook of its
    own, or an instance ``forward``."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        or "forward" in module.__dict__
    )  # fmt: skip


def hooked(*modules: nn.Module) -> str | None:
    """The first of ``modules`` that PEFT's DoRA would call with something flashdora would skip: a forward,
    pre-forward or backward hook (``weight_norm``'s legacy form is a pre-forward hook), or a forward other than
    ``nn.Linear``'s (an instance ``forward``, a subclass). Its ``_get_name()``, ``"global"`` for a process-wide
    hook, else ``None``. flashdora reads these modules' weights instead of calling them."""
    for module in modules:
        if _called_differently(module) and not zero3_hooks_only(module):
            return module._get_name()
    return "global" if global_hooks() else None


_PLAIN_PARAMS = (torch.Tensor, nn.Parameter)
_function_mode = getattr(torch._C, "_is_torch_function_mode_enabled", None)  # private: where missing, "maybe"


def plain_base(base: nn.Module, x) -> bool:
    """Whether a call of ``base`` on ``x`` may run inside flashdora's C++ layer call (``native/csrc/layer.cpp``),
    where nothing could tell it was not called: a plain ``nn.Linear`` (no subclass, no parametrization, no instance
    ``forward``), no hook on it or process-wide (flashdora's own FSDP2 pre-hook included), no torch function mode,
    its weight (and bias) plain tensors that do not train, ``x`` a plain tensor."""
    if type(base) is not nn.Linear or type(x) is not torch.Tensor or _called_differently(base):
        return False
    if any(_GLOBAL_HOOKS) or _function_mode is None or _function_mode():
        return False
    params = base._parameters
    weight, bias = params.get("weight"), params.get("bias")
    if weight is None or weight.requires_grad or type(weight) not in _PLAIN_PARAMS:
        return False
    return bias is None or (not bias.requires_grad and type(bias) in _PLAIN_PARAMS)


_ZERO3_HOOKS = "deepspeed.runtime.zero.parameter_offload"


def zero3_hooks_only(module: nn.Module) -> bool:
    """Whether every hook on ``module`` is one of DeepSpeed ZeRO-3's module hooks and its forward is its class's:
    such a module need not be called, since DeepSpeed gathers the parameters its caller reads (docs/host-notes.md).
    Told by DeepSpeed's private closure names: only on a tested DeepSpeed (``config.TESTED``)."""
    if (
        module._backward_hooks or module._backward_pre_hooks or "forward" in module.__dict__
        or torch.compiler.is_compiling() or not config.deepspeed_tested()
    ):  # fmt: skip
        return False  # (compiling: DeepSpeed gathers nothing read then, and ``reason`` cannot look: PEFT's forward)
    for hooks in (module._forward_hooks, module._forward_pre_hooks):
        for hook in hooks.values():
            if not _zero3_hook(hook):
                return False
    return True


def _zero3_hook(fn) -> bool:
    """Whether ``fn`` is a closure of ``DeepSpeedZeRoOffload._register_deepspeed_module`` (through
    ``torch.compiler.disable``'s ``__wrapped__`` or ``deepspeed.utils.nvtx.instrument_w_nvtx``'s closure)."""
    fn = getattr(fn, "__wrapped__", fn)
    if getattr(fn, "__module__", None) == "deepspeed.utils.nvtx" and getattr(fn, "__closure__", None):
        inner = [c.cell_contents for c in fn.__closure__ if callable(c.cell_contents)]
        fn = inner[0] if len(inner) == 1 else fn
    qualname = getattr(fn, "__qualname__", "")
    return getattr(fn, "__module__", None) == _ZERO3_HOOKS and qualname.startswith(
        "DeepSpeedZeRoOffload._register_deepspeed_module.<locals>."
    )


def hooked_adapter(module: nn.Module, adapter: str) -> str | None:
    """``hooked`` for the ``lora_A``, ``lora_B`` and magnitude modules of ``module``'s ``adapter``; lora_A's and
    lora_B's class must run ``nn.Linear``'s forward."""
    mods = module._modules
    lora_A, lora_B = mods["lora_A"]._modules[adapter], mods["lora_B"]._modules[adapter]
    for layer in (lora_A, lora_B):
        if type(layer).forward not in _PLAIN_FORWARDS:
            return layer._get_name()
    return hooked(lora_A, lora_B, mods["lora_magnitude_vector"]._modules[adapter])


_BNB_LAYERS = ("Linear4bit", "Linear8bitLt")  # bitsandbytes' quantized layers (QDoRA): class names, no bnb import


def is_bnb(base) -> bool:
    """Whether ``base`` is a bitsandbytes 4-bit or 8-bit Linear layer."""
    kind = type(base)
    return kind.__name__ in _BNB_LAYERS and kind.__module__.startswith("bitsandbytes")


def _sharded(t) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 parameter between forwards)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _gathered(t, at_rest: bool = False) -> bool:
    """Whether ``t`` is not a DeepSpeed ZeRO-3 parameter (tagged ``ds_id``) or is one gathered now (``ds_status``
    AVAILABLE; ``at_rest``: any with a ``ds_status``, which the engine's forward gathers). A parameter gathered in the
    engine's forward stays gathered for that layer's backward and recomputation (docs/host-notes.md)."""
    if not hasattr(t, "ds_id"):
        return True
    status = getattr(getattr(t, "ds_status", None), "name", None)
    if at_rest:
        return status is not None
    return status == "AVAILABLE" and t.numel() == getattr(t, "ds_numel", -1)


def reason(base, weight, lora_A, lora_B_layer, lora_B, magnitude, at_rest: bool = False) -> str | None:
    """``unsupported_reason`` from the layer's parts, as the forward has them in hand (``at_rest``: outside a
    forward, where DeepSpeed's ZeRO-3 parameters are partitioned)."""
    if (hasattr(lora_A, "ds_id") or hasattr(weight, "ds_id")) and not torch.compiler.is_compiling():
        parts = (weight, lora_A, lora_B, magnitude)
        if not config.deepspeed_tested() or not all(_gathered(t, at_rest) for t in parts):
            return "deepspeed_zero3"  # a ZeRO-3 parameter not gathered now (empty: PEFT's forward gathers it), or an
            # untested DeepSpeed, whose module hooks flashdora cannot tell from a user's (``zero3_hooks_only``)
        if isinstance(base, Conv1D):  # ``weight.T``, a view, would keep the gathered weight alive until the backward
            return "deepspeed_zero3:fan_in_fan_out"
    if not isinstance(base, (nn.Linear, Conv1D)):
        return f"base:{type(base).__name__}"
    if (type(weight) not in (nn.Parameter, torch.Tensor) or weight.dtype not in _FLOATS) and not is_bnb(base):
        if not (_sharded(weight) and weight.dtype in _FLOATS):  # FSDP2 at rest: its forward sees the gathered weight
            return f"quantized:{type(base).__name__}"
    if param(lora_B_layer, "bias") is not None:
        return "lora_bias"
    device = weight.device
    if lora_A.device != device or lora_B.device != device or magnitude.device != device:
        return "devices:adapter and base weight on different devices"
    return None
