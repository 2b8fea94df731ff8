"""Factored DoRA row norm for float32 weights: one fused kernel, float32-accurate on 3-pass TF32.

``||W||^2 + 2s <W A^T, B>_row + s^2 <B G, B>_row`` with ``G = A A^T`` (derivation: docs/math.md). Each program
owns a [BLOCK_M rows, BLOCK_R slice of r] tile, accumulates ``2s W_rows A_slice^T`` over d_in, adds
``s^2 B_rows G[:, slice]`` (K = r) into the same accumulator and dots the tile with ``B[rows, slice]``, so the
``[d_out, r]`` product never reaches memory. Slices write partial sums to a ``[n_r_blocks, d_out]`` buffer, added in
a fixed order (``scales.finish``, or ``norm.factored_norm_sq``); ``||W||^2`` comes from the caller (the norm cache
keeps it per weight version). 16-bit weights take ``norm_gemm`` or ``norm_small`` (``kernels/norm.py`` chooses).
Eager twin: ``norm_sq_eager`` in ``ops/norm.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdora.kernels import configs, launcher
from flashdora.kernels._common import HALF, _gram_term


@triton.autotune(
    configs=configs.NORM_FWD,
    key=["d_out", "d_in", "r"],
    prune_configs_by={"early_config_prune": configs.prune_norm},
    do_bench=configs.bench,
)
@triton.heuristics({"EVEN_K": lambda args: args["d_in"] % args["BLOCK_K"] == 0})
@triton.jit
def _norm_fwd_kernel(
    p_w, p_a, p_b, p_gram, p_part,
    d_out, d_in, r, two_s, s_sq,
    stride_wm, stride_wk, stride_ar, stride_bm, stride_br,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Partial squared norms (cross and Gram terms) of BLOCK_M rows from one BLOCK_R slice of r."""
    pid = tl.program_id(0)
    n_rb = tl.cdiv(r, BLOCK_R)
    # Slices of one row block are neighbours in launch order, so they share W's tiles through L2.
    pid_m = (pid // n_rb).to(tl.int64)
    pid_r = (pid % n_rb).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # [BLOCK_M]
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # [BLOCK_R]
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # [BLOCK_K]
    mask_m = offs_m < d_out
    mask_r = offs_r < r

    p_wk = p_w + offs_m[:, None] * stride_wm + offs_k[None, :] * stride_wk  # [BLOCK_M, BLOCK_K]
    p_ak = p_a + offs_k[:, None] + offs_r[None, :] * stride_ar  # [BLOCK_K, BLOCK_R], A^T of the slice
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k in range(0, d_in, BLOCK_K):
        if EVEN_K:
            b_w = tl.load(p_wk, mask=mask_m[:, None], other=0.0)
            b_a = tl.load(p_ak, mask=mask_r[None, :], other=0.0)
        else:
            mask_k = (k + offs_k) < d_in
            b_w = tl.load(p_wk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b_a = tl.load(p_ak, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc = tl.dot(b_w, b_a, acc, input_precision="tf32x3")
        p_wk += BLOCK_K * stride_wk
        p_ak += BLOCK_K

    acc = acc * two_s
    acc = _gram_term(
        acc, p_b, p_gram, offs_m, offs_r, mask_m, mask_r, r, stride_bm, stride_br, s_sq, True, "tf32x3", BLOCK_G
    )  # fmt: skip

    p_bs = p_b + offs_m[:, None] * stride_bm + offs_r[None, :] * stride_br
    b_bs = tl.load(p_bs, mask=mask_m[:, None] & mask_r[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_R]
    tl.store(p_part + pid_r * d_out + offs_m, tl.sum(acc * b_bs, axis=1), mask=mask_m)


@triton.jit
def _gram_kernel(
    p_a, p_part, r, d_in, k_per_split, stride_ar,
    PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_R, BLOCK_R] tile of ``A A^T`` over one split of d_in (split-K; the splits are summed by torch)."""
    pid_i = tl.program_id(0).to(tl.int64)
    pid_j = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2).to(tl.int64)
    offs_i = pid_i * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # [BLOCK_R]
    offs_j = pid_j * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # [BLOCK_R]
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # [BLOCK_K]
    mask_i = offs_i < r
    mask_j = offs_j < r
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, d_in)
    acc = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        mask_k = (k + offs_k) < k_end
        b_i = tl.load(
            p_a + offs_i[:, None] * stride_ar + (k + offs_k)[None, :],
            mask=mask_i[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_K]
        b_j = tl.load(
            p_a + offs_j[None, :] * stride_ar + (k + offs_k)[:, None],
            mask=mask_k[:, None] & mask_j[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]
        acc = tl.dot(b_i, b_j, acc, input_precision=PRECISION)
    p_out = p_part + pid_s * r * r + offs_i[:, None] * r + offs_j[None, :]
    tl.store(p_out, acc, mask=mask_i[:, None] & mask_j[None, :])


def gram(lora_A: torch.Tensor) -> torch.Tensor:
    """``A A^T`` [r, r] float32 by a split-K ``tf32x3`` kernel (float32-accurate), for the float32 norm: cuBLAS
    float32 has too few output tiles for that long K, and plain TF32 is not float32-accurate (docs/host-notes.md)."""
    a = lora_A.detach().float().contiguous()  # [r, d_in]
    r, d_in = a.shape
    block_r, block_k = configs.gram_blocks(r)
    tiles = triton.cdiv(r, block_r)
    n_split = configs.gram_splits(tiles, d_in, block_k, a.device)
    k_per_split = triton.cdiv(triton.cdiv(d_in, n_split), block_k) * block_k
    n_split = triton.cdiv(d_in, k_per_split)
    part = torch.empty((n_split, r, r), dtype=torch.float32, device=a.device)
    _gram_kernel[(tiles, tiles, n_split)](
        a, part, r, d_in, k_per_split, a.stride(0),
        PRECISION="tf32x3", BLOCK_R=block_r, BLOCK_K=block_k,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return part.sum(0)


def fused_partials(weight, lora_A, lora_B, scaling, w_sq) -> torch.Tensor:
    """``[n_slices + 1, d_out]`` float32 partial squared norms of a float32 ``weight``: the fused kernel's per-r-slice
    sums of the cross and Gram terms (``tf32x3`` throughout), then ``||W||^2`` as the last row."""
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    assert lora_A.shape == (r, d_in) and lora_B.shape == (d_out, r)
    assert d_out > 0 and d_in > 0 and r > 0
    a = lora_A.detach().to(weight.dtype).contiguous()  # [r, d_in]
    b = lora_B if lora_B.dtype in (*HALF, torch.float32) else lora_B.float()
    g = gram(lora_A)  # [r, r], symmetric
    block_r = configs.norm_block_r(r)
    n_slices = triton.cdiv(r, block_r)
    part = torch.empty((n_slices + 1, d_out), dtype=torch.float32, device=weight.device)
    grid = lambda meta: (triton.cdiv(d_out, meta["BLOCK_M"]) * n_slices,)
    args = (
        weight, a, b, g, part,
        d_out, d_in, r, 2.0 * scaling, scaling * scaling,
        weight.stride(0), weight.stride(1), a.stride(0), b.stride(0), b.stride(1),
    )  # fmt: skip
    flags = dict(BLOCK_R=block_r, BLOCK_G=configs.NORM_GRAM_BLOCK_K)
    launcher.launch(_norm_fwd_kernel, grid, (d_out, d_in, r, weight.dtype, b.dtype), args, flags)
    part[-1] = w_sq
    return part
