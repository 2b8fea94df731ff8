"""Which kernel computes a layer's factored DoRA row norm (and DoRA's scales with it), by the weight's dtype and rank.

``||W + s B A||^2 = ||W||^2 + 2s <W A^T, B>_row + s^2 <B G, B>_row`` with ``G = A A^T`` (docs/math.md):

- a 16-bit weight with ``r <= norm_small.MAX_R``: ``norm_small``, norm and scales in one kernel (two where it splits
  d_in);
- other 16-bit weights: ``norm_gemm`` (the GEMMs on cuBLAS, one Triton epilogue);
- float32 weights: ``norm_fp32``'s fused kernel (float32-accurate, 3-pass TF32);

then ``scales.finish`` sums the partial rows and writes the norm and the scales. Eager twin: ``norm_sq_eager`` and
``scales`` in ``ops/norm.py``.
"""

from __future__ import annotations

import torch

from flashdora.kernels import norm_small
from flashdora.kernels._common import HALF
from flashdora.kernels.norm_fp32 import fused_partials
from flashdora.kernels.norm_gemm import norm_half, weight_sq
from flashdora.kernels.scales import finish, outputs


def _partials(weight, lora_A, lora_B, scaling, w_sq) -> torch.Tensor:
    """``[n, d_out]`` float32 partial squared row norms of ``W + s B A`` (column sums: the squared norms, ``||W||^2``
    included), by ``norm_gemm`` for 16-bit ``weight``, else ``norm_fp32``'s fused kernel (3-pass TF32). ``w_sq``: a
    known ``||W||^2``, else computed here."""
    weight = weight if weight.dtype in (*HALF, torch.float32) else weight.float()  # float64 (references)
    w_sq = weight_sq(weight) if w_sq is None else w_sq
    if weight.dtype in HALF:
        return norm_half(weight, lora_A, lora_B, scaling, w_sq)
    return fused_partials(weight, lora_A, lora_B, scaling, w_sq)


def factored_norm_sq(weight, lora_A, lora_B, scaling, w_sq=None) -> torch.Tensor:
    """Triton ``norm_sq_eager``: ``[d_out]`` float32 squared row norms of ``W + s B A``, not clamped.

    ``w_sq``: a known ``||W||^2`` (the norm cache's), else computed here.
    """
    return _partials(weight, lora_A, lora_B, scaling, w_sq).sum(0)


def norm_and_scales(weight, lora_A, lora_B, scaling, magnitude, out=None, w_sq=None):
    """``(norm, scales)`` in one go: the factored norm finished together with ``ops.norm.scales``.

    Eleven small launches fewer than ``factored_norm_sq`` + clamp + sqrt + ``scales``: host time, not GPU time, at
    ordinary layer sizes. ``out``: a ``[4, d_out]`` float32 buffer to write ``norm`` (row 0) and the scales (rows
    1-3) into, or a ``(norm, scales)`` pair of views to write.
    ``w_sq``: a known ``||W||^2``. A 16-bit ``weight`` with a rank up to ``norm_small.MAX_R`` takes one launch, two
    where it splits d_in (``kernels/norm_small.py``).
    """
    if norm_small.takes(weight, lora_A):
        w_sq = weight_sq(weight) if w_sq is None else w_sq
        norm, scales = outputs(out, weight.shape[0], weight.device)
        norm_small.norm_and_scales(weight, lora_A, lora_B, scaling, magnitude, w_sq, norm, scales)
        return norm, scales
    return finish(_partials(weight, lora_A, lora_B, scaling, w_sq), magnitude, True, out)
