"""Argument validation for the public functions: each failure names the function, the argument, expected vs got."""

from __future__ import annotations

import math
import numbers

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor(fn: str, name: str, value, *, ndim: int | None = None) -> torch.Tensor:
    """A floating-point tensor with ``ndim`` dimensions (when given)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{fn}: {name} expected a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
        raise TypeError(f"{fn}: {name} expected a floating dtype ({names}), got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{fn}: {name} expected {ndim} dimensions, got shape {list(value.shape)}")
    return value


def shape(fn: str, name: str, value: torch.Tensor, expected: list[int], origin: str) -> None:
    if list(value.shape) != list(expected):
        raise ValueError(f"{fn}: {name} expected shape {list(expected)} (from {origin}), got {list(value.shape)}")


def same_device(fn: str, name: str, value: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if value.device != ref.device:
        raise ValueError(f"{fn}: {name} expected device {ref.device} (the device of {ref_name}), got {value.device}")


def scaling(fn: str, value) -> float:
    """A finite real number (Python or 0-d tensor), returned as a float."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: scaling expected a real number, got {type(value).__name__}")
    try:
        as_float = float(value)
    except OverflowError:  # an int or Fraction beyond float's range (10**400)
        raise ValueError(f"{fn}: scaling expected a finite number, got one beyond float's range") from None
    if not math.isfinite(as_float):
        raise ValueError(f"{fn}: scaling expected a finite number, got {as_float}")
    return as_float


def positive_int(fn: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{fn}: {name} expected a positive integer, got {value!r}")
    return int(value)


def lora_pair(fn: str, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> tuple[int, int, int]:
    """Checks ``weight [d_out, d_in]``, ``lora_A [r, d_in]``, ``lora_B [d_out, r]``; returns ``(d_out, d_in, r)``."""
    tensor(fn, "weight", weight, ndim=2)
    tensor(fn, "lora_A", lora_A, ndim=2)
    tensor(fn, "lora_B", lora_B, ndim=2)
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    shape(fn, "lora_A", lora_A, [r, d_in], "weight's d_in")
    if lora_B.shape[1] != r:
        raise ValueError(
            f"{fn}: lora_B expected shape [d_out, r] = [{d_out}, {r}] (rank r from lora_A), got {list(lora_B.shape)}"
        )
    shape(fn, "lora_B", lora_B, [d_out, r], "weight and lora_A")
    if r == 0 or d_out == 0 or d_in == 0:
        raise ValueError(f"{fn}: expected non-empty weight and rank >= 1, got weight {list(weight.shape)}, r = {r}")
    same_device(fn, "lora_A", lora_A, weight, "weight")
    same_device(fn, "lora_B", lora_B, weight, "weight")
    return d_out, d_in, r
