"""``factored_norm``: the DoRA row norm ``||W + s B A||`` without forming ``B @ A`` (derivation: docs/math.md)."""

from __future__ import annotations

import torch

from flashdora import _checks, backend

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
    its own rows instead. Tiny negative round-off is clamped to 0 before the square root.

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
    return norm_from_parts(weight, lora_A, lora_B, scaling, chunk_size)


@torch.no_grad()
def norm_from_parts(weight, lora_A, lora_B, scaling: float, chunk_size: int | None = None) -> torch.Tensor:
    """The validated core of ``factored_norm`` (also called by ``dora_linear`` and the PEFT variant)."""
    if backend.use_triton(weight, lora_A, lora_B):
        from flashdora.kernels.norm import factored_norm_sq

        backend.count("norm:triton")
        sq = factored_norm_sq(weight, lora_A, lora_B, scaling)
    else:
        backend.count("norm:eager")
        sq = norm_sq_eager(weight, lora_A, lora_B, scaling, chunk_size)
    return sq.clamp_min_(0.0).sqrt_()


def norm_sq_eager(weight, lora_A, lora_B, scaling: float, chunk_size: int | None = None) -> torch.Tensor:
    """Chunked float32-accumulating ``||W + s B A||^2`` per row, in plain torch."""
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
        sq = torch.linalg.vector_norm(w, dim=1, dtype=acc).square_()
        cross = (w @ a_mm.T).to(acc)  # [c, r]
        sq += (2.0 * scaling) * (cross * b).sum(1)
        sq += (scaling * scaling) * ((b @ gram) * b).sum(1)
        out[i : i + chunk] = sq
    return out
