"""Two dtype helpers the compose's Python and C++ bridges share (a leaf: imports only torch)."""

from __future__ import annotations

import torch


def cast(t, dtype):
    """``t`` in ``dtype`` (``None``: as it is), without a torch call when it already is: a no-op ``.to()`` still
    costs one on the host path."""
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def compute_dtype(device_type: str, lora_A: torch.Tensor, autocast: bool) -> torch.dtype:
    """The LoRA matmul dtype PEFT gets: the autocast dtype under autocast, else the adapter's dtype."""
    return torch.get_autocast_dtype(device_type) if autocast else lora_A.dtype


def autocast_on(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, ``False`` for meta tensors (autocast has no meta device: torch
    raises for it)."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)
