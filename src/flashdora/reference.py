"""Plain-torch ground truth, written for clarity (the dense ``W + s B A`` is fine here).

Tests and ``flashdora parity`` run these in float64; ``ops/`` uses ``dora_linear_ref`` only under ``torch.func``
transforms (``dora_linear``'s fallback), ``kernels/`` never.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def row_norm_ref(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """``||W + s B A||`` per output row, densely. Shapes: ``[d_out, d_in]``, ``[r, d_in]``, ``[d_out, r]``."""
    return torch.linalg.vector_norm(weight + scaling * (lora_B @ lora_A), dim=1)


def dora_linear_ref(x, weight, bias, lora_A, lora_B, magnitude, scaling, lora_x=None) -> torch.Tensor:
    """The DoRA linear layer as PEFT defines it, with the norm detached (DoRA paper, sec. 4.3).

    ``lora_x is None``: ``y = g (x W^T + s x A^T B^T) + bias``; otherwise the delta acts on ``lora_x`` (the
    dropout-applied input) and the frozen base on ``x``:
    ``y = x W^T + bias + (g - 1) lora_x W^T + g s lora_x A^T B^T``.
    """
    g = magnitude / row_norm_ref(weight, lora_A, lora_B, scaling).detach()
    if lora_x is None:
        return g * (F.linear(x, weight) + scaling * F.linear(F.linear(x, lora_A), lora_B)) + (
            0 if bias is None else bias
        )
    base = F.linear(x, weight, bias)
    return base + (g - 1) * F.linear(lora_x, weight) + g * scaling * F.linear(F.linear(lora_x, lora_A), lora_B)
