"""flashdora: DoRA at the cost of LoRA, as a one-line drop-in for PEFT.

import flashdora
flashdora.enable(peft_model)   # or flashdora.patch_peft() before building the model
"""

import importlib
import sys

__version__ = "0.1.0"

# public name -> module that defines it; loaded on first use (PEP 562), so `flashdora --help` imports no torch
_EXPORTS = {
    "factored_norm": "flashdora.ops",
    "dora_linear": "flashdora.ops",
    "enable": "flashdora.peft.switch",
    "disable": "flashdora.peft.switch",
    "patch_peft": "flashdora.peft.switch",
    "unpatch_peft": "flashdora.peft.switch",
    "stats": "flashdora.backend",
    "reset_stats": "flashdora.backend",
    "report": "flashdora.report",
    "invalidate": "flashdora.ops.norm_cache",
    "configure": "flashdora.config",
    "double_backward": "flashdora.ops.compose_grad2",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashdora' has no attribute {name!r}")
    for export, module in _EXPORTS.items():  # all at once: importing flashdora.report binds the module to `report`
        globals()[export] = getattr(importlib.import_module(module), export)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if "peft" in sys.modules:  # PEFT already loaded (and torch with it): wrap its hotswap functions now (docs/design.md)
    importlib.import_module("flashdora.peft.watch")
