"""Factored DoRA row norm for 16-bit weights: its two big GEMMs on cuBLAS, everything else in one Triton epilogue.

``||W + s B A||^2 = ||W||^2 + 2s <W A^T, B>_row + s^2 <B G, B>_row`` with ``G = A A^T`` (docs/math.md), for the
weight the forward really applies: with ``A`` rounded to W's dtype, as the LoRA matmul's own cast rounds it.

1. ``a = A`` in W's 16-bit dtype (one cast), ``G = a a^T`` by cuBLAS, float32 out.
2. ``C = W a^T`` by cuBLAS, float32 out: the tensor cores at their GEMM rate, which our Triton GEMM fell well short
   of (docs/host-notes.md). Written as ``[rows, r]`` or as its transpose, whichever layout cuBLAS
   runs faster at this shape (timed once per shape).
3. ``_epilogue_kernel``, per [rows, r-slice] tile: ``B G[:, slice]`` on TF32 (a plain GEMM loop, K = r), the
   row-dot of ``2s C + s^2 B G`` with ``B``, plus ``||W||^2`` in slice 0 (given: the norm cache keeps it per weight
   version); ``kernels/scales.py`` sums the slices and computes the norm and DoRA's scales in one more launch.

``C`` is ``[rows, r]`` fp32, walked in row chunks of at most 64 MiB. Eager twin: ``norm_sq_eager`` in
``ops/norm.py``. float32 weights take ``kernels/norm_fp32.py``'s fused kernel (float32-accurate TF32x3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdora import backend
from flashdora.kernels import configs, launcher
from flashdora.kernels._common import _gram_term

_CHUNK_ELEMENTS = 16 * 1024 * 1024  # fp32 elements of C per chunk (64 MiB)


@triton.jit
def _row_sq_kernel(p_w, p_out, d_out, d_in, stride_wm, stride_wk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``||W_rows||^2`` of BLOCK_M rows, float32 accumulation, one read of W."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # [BLOCK_M]
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # [BLOCK_K]
    mask_m = offs_m < d_out
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k in range(0, d_in, BLOCK_K):
        mask = mask_m[:, None] & ((k + offs_k) < d_in)[None, :]
        p = p_w + offs_m[:, None] * stride_wm + (k + offs_k)[None, :] * stride_wk
        b_w = tl.load(p, mask=mask, other=0.0).to(tl.float32)
        acc += b_w * b_w
    tl.store(p_out + offs_m, tl.sum(acc, axis=1), mask=mask_m)


@triton.autotune(configs=configs.NORM_EPILOGUE, key=["r"], do_bench=configs.bench)
@triton.jit(do_not_specialize=["rows"])
def _epilogue_kernel(
    p_c, p_b, p_gram, p_wsq, p_part,
    rows, r, two_s, s_sq,
    stride_cm, stride_cj, stride_bm, stride_br, stride_part,
    BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M rows, BLOCK_J slice of r] tile: ``T = 2s C + s^2 B G[:, slice]`` (a plain GEMM loop over K = r
    on TF32) dotted with ``B[rows, slice]``; one partial squared norm per row and slice (slice 0 adds ``||W||^2``)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_j = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # [BLOCK_M]
    offs_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J).to(tl.int64)  # [BLOCK_J]
    mask_m = offs_m < rows
    mask_j = offs_j < r
    bg = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
    bg = _gram_term(
        bg, p_b, p_gram, offs_m, offs_j, mask_m, mask_j, r, stride_bm, stride_br, 1.0, False, "tf32", BLOCK_G
    )  # fmt: skip
    mask = mask_m[:, None] & mask_j[None, :]
    b_c = tl.load(p_c + offs_m[:, None] * stride_cm + offs_j[None, :] * stride_cj, mask=mask, other=0.0)
    p_bj = p_b + offs_m[:, None] * stride_bm + offs_j[None, :] * stride_br
    b_bj = tl.load(p_bj, mask=mask, other=0.0).to(tl.float32)
    part = tl.sum((two_s * b_c + s_sq * bg) * b_bj, axis=1)  # [BLOCK_M]
    if pid_j == 0:
        part += tl.load(p_wsq + offs_m, mask=mask_m, other=0.0)
    tl.store(p_part + pid_j * stride_part + offs_m, part, mask=mask_m)


def _mm_f32(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` of 16-bit operands with float32 accumulation and output (cuBLAS on CUDA; exact products in float32
    elsewhere, which is what the GPU's tensor cores compute, summed in another order)."""
    if x.is_cuda:
        return torch.mm(x, y, out_dtype=torch.float32)
    return torch.mm(x.float(), y.float())


# (rows, d_in, r, dtype, device) -> whether cuBLAS runs the cross term faster as ``C^T = a W^T`` (``[r, rows]``)
# than as ``C = W a^T``: the same product, tiled differently.
# Neither layout wins at every shape (docs/host-notes.md), so each shape's first computation times both and keeps
# the faster.
_TRANSPOSED: dict[tuple, bool] = {}
_LAYOUT_REPS = 3


def _cross_term(w_rows: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(C, stride over rows, stride over r)`` with ``C = w_rows a^T`` float32, in the layout cuBLAS runs faster."""
    key = (*w_rows.shape, a.shape[0], w_rows.dtype, w_rows.device)
    transposed = _TRANSPOSED.get(key)
    if transposed is None:
        transposed = _faster_transposed(w_rows, a, key)
    if transposed:
        c = _mm_f32(a, w_rows.T)  # [r, rows]
        return c, 1, c.stride(0)
    c = _mm_f32(w_rows, a.T)  # [rows, r]
    return c, c.stride(0), 1


def _faster_transposed(w_rows, a, key) -> bool:
    """Times both layouts on the GPU (a few calls each, once per shape) and files the choice; ``False`` elsewhere and
    while a CUDA graph is being captured (nothing may be timed then; the next eager call decides)."""
    if not w_rows.is_cuda:
        _TRANSPOSED[key] = False
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    times = []
    for fn in (lambda: _mm_f32(w_rows, a.T), lambda: _mm_f32(a, w_rows.T)):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(_LAYOUT_REPS):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    _TRANSPOSED[key] = times[1] < times[0]
    return _TRANSPOSED[key]


def gram(a: torch.Tensor) -> torch.Tensor:
    """``a a^T`` ``[r, r]`` float32 of a 16-bit ``a`` (exact products, float32 sums), one cuBLAS GEMM on CUDA (a
    split over d_in was slower: docs/host-notes.md)."""
    return _mm_f32(a, a.T)


def weight_sq(weight: torch.Tensor) -> torch.Tensor:
    """``||W||^2`` per row ``[d_out]`` float32 (float32 accumulation; no transient copy of W)."""
    d_out, d_in = weight.shape
    out = torch.empty(d_out, dtype=torch.float32, device=weight.device)
    block_m, block_k = (8, 512) if not configs.INTERPRETED else (8, 32)
    _row_sq_kernel[(triton.cdiv(d_out, block_m),)](
        weight, out, d_out, d_in, weight.stride(0), weight.stride(1), BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4
    )
    return out


def norm_half(weight, lora_A, lora_B, scaling, w_sq) -> torch.Tensor:
    """``[n_slices, d_out]`` float32 partial squared row norms of ``W + s B A`` for a 16-bit ``weight`` (their column
    sums are the squared norms; ``w_sq``, ``||W||^2``, is added in slice 0).

    Autocast is off inside: it would run the float32 matmuls of the CPU path in 16 bits."""
    with backend.autocast_off(weight.device.type):
        return _norm_half(weight, lora_A, lora_B, scaling, w_sq)


def _norm_half(weight, lora_A, lora_B, scaling, w_sq) -> torch.Tensor:
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    a = lora_A.detach().to(weight.dtype)  # [r, d_in]
    g = gram(a)
    block_j = configs.norm_block_r(r)  # fixed, not tuned: it sets the number of partial rows
    part = torch.empty((triton.cdiv(r, block_j), d_out), dtype=torch.float32, device=weight.device)
    chunk = max(1, _CHUNK_ELEMENTS // r)
    for i in range(0, d_out, chunk):
        rows = min(chunk, d_out - i)
        c, stride_cm, stride_cj = _cross_term(weight[i : i + rows], a)  # C = W a^T, [rows, r] or transposed
        b = lora_B[i : i + rows]
        grid = lambda meta, rows=rows: (triton.cdiv(rows, meta["BLOCK_M"]), triton.cdiv(r, block_j))  # noqa: E731
        args = (
            c, b, g, w_sq[i : i + rows], part[:, i : i + rows],
            rows, r, 2.0 * scaling, scaling * scaling,
            stride_cm, stride_cj, b.stride(0), b.stride(1), part.stride(0),
        )  # fmt: skip
        launcher.launch(_epilogue_kernel, grid, (r, b.dtype), args, dict(BLOCK_J=block_j))
    return part
