"""``enable``'s check that it found something to switch: a model without PEFT DoRA layers gets one warning.

A PEFT LoRA model built without ``use_dora=True``, a plain transformers model or a bare ``nn.Linear`` would
otherwise pass through ``enable`` unchanged and without a word, and train at PEFT's (or torch's) speed.
"""

from __future__ import annotations

import warnings

from peft.tuners.lora.layer import LoraLayer
from torch import nn


def count_dora_layers(model: nn.Module) -> tuple[int, int]:
    """(PEFT LoRA layers in ``model``, those with ``use_dora=True`` for at least one adapter)."""
    lora = dora = 0
    for module in model.modules():
        if isinstance(module, LoraLayer):
            lora += 1
            dora += any(getattr(module, "use_dora", {}).values())
    return lora, dora


def warn_if_nothing_to_enable(model: nn.Module) -> None:
    """One ``UserWarning`` naming what ``enable`` found when ``model`` holds no PEFT DoRA layer; silent otherwise."""
    lora, dora = count_dora_layers(model)
    if dora:
        return
    name = type(model).__name__
    if lora:
        found = f"{lora} LoRA layer{'s' if lora != 1 else ''}, 0 with use_dora=True"
        fix = "build the adapters with LoraConfig(use_dora=True)"
    else:
        found = "no PEFT LoRA layers"
        fix = "wrap the model with peft.get_peft_model(model, LoraConfig(use_dora=True, ...)) first"
    warnings.warn(f"flashdora.enable: nothing to enable in {name}: {found}; {fix}", UserWarning, stacklevel=3)
