"""Which DoRA Linear layers flashdora runs, and why not the others (``unsupported_reason``), plus the accessors the
per-call forward uses: submodules and parameters read from the modules' own dicts."""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import LoraLayer
from torch import nn
from transformers.pytorch_utils import Conv1D

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def unsupported_reason(module: LoraLayer, adapter: str) -> str | None:
    """Why flashdora cannot run this DoRA Linear layer (``None`` when it can)."""
    mods = module._modules
    base = base_layer(module)
    lora_B_layer = mods["lora_B"]._modules[adapter]
    return reason(
        base, param(base, "weight"), param(mods["lora_A"]._modules[adapter], "weight"), lora_B_layer,
        param(lora_B_layer, "weight"), param(mods["lora_magnitude_vector"]._modules[adapter], "weight"),
    )  # fmt: skip


# The forward runs once per layer call, where host time is the bottleneck: it reads submodules and parameters from
# the modules' own dicts. ``nn.Module.__getattr__`` costs a Python call per attribute, and PEFT's
# ``get_base_layer`` a caught AttributeError per call (about 2 and 5 us on a laptop CPU, against 0.15).


def base_layer(module: nn.Module) -> nn.Module:
    """PEFT's ``get_base_layer``: the innermost ``base_layer`` (nested when LoRA layers wrap LoRA layers)."""
    while "base_layer" in module._modules:
        module = module._modules["base_layer"]
    return module


def param(module: nn.Module, name: str):
    """``getattr(module, name)`` for a registered parameter, without ``nn.Module.__getattr__``."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name, None)


_BNB_LAYERS = ("Linear4bit", "Linear8bitLt")  # bitsandbytes' quantized layers (QDoRA): class names, no bnb import


def is_bnb(base) -> bool:
    """Whether ``base`` is a bitsandbytes 4-bit or 8-bit Linear layer."""
    kind = type(base)
    return kind.__name__ in _BNB_LAYERS and kind.__module__.startswith("bitsandbytes")


def dequantized(base) -> torch.Tensor:
    """A bitsandbytes layer's weight as the dense tensor its own forward computes with (PEFT's dequantization).

    A 4-bit weight goes straight to ``bitsandbytes.functional.dequantize_4bit``, the call PEFT's
    ``dequantize_module_weight`` makes for it (and ``Linear4bit``'s forward), without PEFT's checks around it: a
    cache miss runs this every optimizer step, and those checks read ``Params4bit`` attributes through its
    ``__torch_function__`` (about 60 us of the host's time per call on the dev machine's CPU)."""
    weight = base.weight
    with torch.no_grad():
        if type(weight).__name__ == "Params4bit" and getattr(weight, "quant_state", None) is not None:
            import bitsandbytes as bnb

            return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(base)


def _sharded(t) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 parameter between forwards)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def reason(base, weight, lora_A, lora_B_layer, lora_B, magnitude) -> str | None:
    """``unsupported_reason`` from the layer's parts, as the forward has them in hand."""
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
