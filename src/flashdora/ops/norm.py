"""``factored_norm``: the DoRA row norm ``||W + s B A||`` without forming ``B @ A`` (derivation: docs/math.md).

Also ``scales`` (``g = m / norm`` and friends) and ``fresh`` (one newly computed ``(norm, scales)``), which the
norm cache (``ops/norm_cache.py``) keeps per weight version.
"""

from __future__ import annotations

import torch

from flashdora import _checks, backend
from flashdora.native import bridge

# Default transient budget of the eager path: 16 Mi fp32 elements (64 MiB) per chunk.
_CHUNK_ELEMENTS = 16 * 1024 * 1024
_HALF = (torch.float16, torch.bfloat16)


def default_chunk_size(d_in: int, r: int) -> int:
    """Rows per chunk that keep one ``[rows, max(d_in, r)]`` fp32 transient under ~64 MiB."""
    return max(1, _CHUNK_ELEMENTS // max(d_in, r))


def factored_norm(weight, lora_A, lora_B, scaling, *, chunk_size=None) -> torch.Tensor:
    """Row norms of ``W + s B A`` from ``||W||^2 + 2s <W A^T, B>_row + s^2 <B (A A^T), B>_row``.

    Never forms ``B @ A``. The eager path walks ``chunk_size`` rows at a time, accumulating in float32, so that no
    intermediate holds more than ``chunk_size * max(d_in, r)`` elements (besides a cast copy of ``lora_A`` when its
    dtype differs from ``weight``'s). With 16-bit ``weight`` the cross-term GEMM runs on 16-bit operands (tensor
    cores on the GPU) with ``lora_A`` cast to ``weight``'s dtype; float32 weights keep float32 operands. When
    ``r >= d_in`` the factored terms are larger than the dense row chunk, so each chunk forms ``W_c + s B_c A`` for
    its own rows instead. Tiny negative round-off is clamped to 0 before the square root. On CUDA tensors the
    fused Triton kernel computes the same sum (``FLASHDORA_BACKEND``); ``chunk_size`` applies to the eager path.

    The result carries no autograd history: DoRA treats the norm as a constant (paper, sec. 4.3).

    Args:
        weight: ``[d_out, d_in]`` base weight (any strides, e.g. the transpose of a ``Conv1D`` weight).
        lora_A: ``[r, d_in]``.
        lora_B: ``[d_out, r]``.
        scaling: finite real ``s``.
        chunk_size: rows per chunk of the eager path; default keeps each transient under ~64 MiB.

    Returns:
        ``[d_out]`` float32 tensor on ``weight``'s device (float64 when an input is float64, for references).

    Raises:
        TypeError: a non-tensor or non-floating argument, or a non-number ``scaling``.
        ValueError: mismatched shapes or devices, non-finite ``scaling``, ``chunk_size < 1``.
    """
    fn = "factored_norm"
    _checks.lora_pair(fn, weight, lora_A, lora_B)
    scaling = _checks.scaling(fn, scaling)
    if chunk_size is not None:
        chunk_size = _checks.positive_int(fn, "chunk_size", chunk_size)
    return compute_norm(weight.detach(), lora_A.detach(), lora_B.detach(), scaling, chunk_size)


@torch.no_grad()
def compute_norm(weight, lora_A, lora_B, scaling: float, chunk_size: int | None = None, w_sq=None) -> torch.Tensor:
    """The validated core: one norm computation on the backend's path, counted as ``norm:<path>``.

    Autocast is off inside: the eager path's fp32 matmuls (``A A^T``, ``(B A A^T)``) would otherwise run in 16 bits.
    """
    if backend.use_triton(weight, lora_A, lora_B):
        from flashdora.kernels.norm import factored_norm_sq

        backend.count("norm:triton")
        sq = factored_norm_sq(weight, lora_A, lora_B, scaling, w_sq)
    else:
        backend.count("norm:eager")
        with backend.autocast_off(weight.device.type):
            sq = norm_sq_eager(weight, lora_A, lora_B, scaling, chunk_size, w_sq)
    return sq.clamp_min_(0.0).sqrt_()


def weight_sq(weight, triton: bool) -> torch.Tensor:
    """``||W||^2`` per row on the Triton path or the eager one (float32 accumulation)."""
    if triton:
        from flashdora.kernels.norm_gemm import weight_sq as weight_sq_triton

        return weight_sq_triton(weight)
    return weight_sq_eager(weight)


def weight_sq_eager(weight, chunk_size: int | None = None) -> torch.Tensor:
    """``||W||^2`` per row, float32 accumulation (float64 for float64 weights), chunked like the norm."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    chunk = chunk_size or default_chunk_size(weight.shape[1], 1)
    parts = [torch.linalg.vector_norm(weight[i : i + chunk], dim=1, dtype=acc) for i in range(0, len(weight), chunk)]
    return torch.cat(parts).square_()


def norm_sq_eager(weight, lora_A, lora_B, scaling: float, chunk_size: int | None = None, w_sq=None) -> torch.Tensor:
    """Chunked float32-accumulating ``||W + s B A||^2`` per row, in plain torch; ``w_sq``: a known ``||W||^2``."""
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    chunk = chunk_size or default_chunk_size(d_in, r)
    acc = torch.float64 if torch.float64 in (weight.dtype, lora_A.dtype, lora_B.dtype) else torch.float32
    out = torch.empty(d_out, dtype=acc, device=weight.device)
    a_acc = lora_A.to(acc)
    if r >= d_in:
        for i in range(0, d_out, chunk):
            rows = torch.addmm(weight[i : i + chunk].to(acc), lora_B[i : i + chunk].to(acc), a_acc, alpha=scaling)
            out[i : i + chunk] = torch.linalg.vector_norm(rows, dim=1).square_()
        return out
    mm_dtype = weight.dtype if weight.dtype in _HALF else acc
    a_mm = lora_A.to(mm_dtype)  # [r, d_in]
    gram = a_acc @ a_acc.T  # [r, r]
    for i in range(0, d_out, chunk):
        w = weight[i : i + chunk].to(mm_dtype)  # [c, d_in], a no-op unless weight is float32 beside float64
        b = lora_B[i : i + chunk].to(acc)  # [c, r]
        if w_sq is None:
            sq = torch.linalg.vector_norm(w, dim=1, dtype=acc).square_()
        else:
            sq = w_sq[i : i + chunk].to(acc, copy=True)
        cross = (w @ a_mm.T).to(acc)  # [c, r]
        sq += (2.0 * scaling) * (cross * b).sum(1)
        sq += (scaling * scaling) * ((b @ gram) * b).sum(1)
        out[i : i + chunk] = sq
    return out


def scales(magnitude: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``[3, d_out]``: rows ``g = m / norm``, ``g - 1 = (m - norm) / norm`` and ``1 / norm``, in float32.

    (float64 for float64 inputs.) A row with ``norm == 0`` (its W row and LoRA delta are both zero) gets ``g = 0``,
    ``g - 1 = -1`` and ``1 / norm = 0``: it outputs its bias and gets a zero magnitude gradient, never NaN.
    """
    acc = torch.promote_types(magnitude.dtype, torch.float32)
    m, n = magnitude.detach().to(acc), norm.detach().to(acc)
    positive = n > 0
    inv = torch.where(positive, 1.0 / n, torch.zeros_like(n))
    gm1 = torch.where(positive, (m - n) * inv, torch.full_like(n, -1.0))
    return torch.stack([m * inv, gm1, inv])


def scales_on(magnitude, norm, triton: bool) -> torch.Tensor:
    """``scales`` on the Triton path (one launch) or the eager one."""
    if triton:
        from flashdora.kernels.scales import scales_from_norm

        return scales_from_norm(magnitude, norm)
    return scales(magnitude, norm)


@torch.no_grad()
def fresh(weight, lora_A, lora_B, magnitude, scaling, impl: str, w_sq=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A newly computed ``(norm, scales)`` by ``impl`` (``dispatch.norm_impl``: ``eager``, ``triton``, ``native``); on
    the Triton path the norm's finish and the scales are one launch. ``native`` replays the Triton launches from C++
    once planned (with ``w_sq`` given: a cache miss)."""
    if impl not in ("eager", "triton", "native"):
        raise ValueError(f"fresh: impl expected one of 'eager', 'triton', 'native', got {impl!r}")
    if impl != "eager":
        from flashdora.kernels.norm import norm_and_scales

        backend.count("norm:triton")
        if impl != "native" or w_sq is None:
            return norm_and_scales(weight, lora_A, lora_B, scaling, magnitude, w_sq=w_sq)
        python = lambda: norm_and_scales(weight, lora_A, lora_B, scaling, magnitude, w_sq=w_sq)  # noqa: E731
        return bridge.norm_scales(weight, lora_A, lora_B, magnitude, scaling, w_sq, python)
    norm = compute_norm(weight, lora_A, lora_B, scaling, w_sq=w_sq)
    return norm, scales(magnitude, norm)
