"""Factored DoRA row norm for float32 weights, and the finish into DoRA's scales.

``||W||^2 + 2s <W A^T, B>_row + s^2 <B G, B>_row`` with ``G = A A^T`` (derivation: docs/math.md). 16-bit weights
(the common case) take ``norm_gemm``; float32 weights take the fused kernel here, float32-accurate on 3-pass TF32:
each program owns a [BLOCK_M rows, BLOCK_R slice of r] tile, accumulates ``2s W_rows A_slice^T`` over d_in, adds
``s^2 B_rows G[:, slice]`` (K = r) into the same accumulator and dots the tile with ``B[rows, slice]``, so the
``[d_out, r]`` product never reaches memory. Slices write partial sums to a ``[n_r_blocks, d_out]`` buffer, added in
a fixed order; ``||W||^2`` comes from the caller (the norm cache keeps it per weight version). Eager twin:
``norm_sq_eager`` in ``ops/norm.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdora.kernels import configs, launcher, norm_gemm, norm_small
from flashdora.kernels.norm_gemm import _gram_term, norm_half, weight_sq
from flashdora.kernels.norm_small import _store_scales

_HALF = (torch.float16, torch.bfloat16)


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
    """``A A^T`` [r, r] float32 by a split-K ``tf32x3`` kernel (float32-accurate; ~3e-7 relative measured).

    It serves the float32 norm (float32 weights). cuBLAS float32 takes 0.079 ms at r = 384, d_in = 8192 on an H100
    (too few output tiles for that long K); this takes 0.062 ms. Plain TF32 would be faster but not float32-accurate.
    """
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


def _fused_partials(weight, lora_A, lora_B, scaling, w_sq) -> torch.Tensor:
    """``[n_slices + 1, d_out]`` float32 partial squared norms of a float32 ``weight``: the fused kernel's per-r-slice
    sums of the cross and Gram terms (``tf32x3`` throughout), then ``||W||^2`` as the last row."""
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    assert lora_A.shape == (r, d_in) and lora_B.shape == (d_out, r)
    assert d_out > 0 and d_in > 0 and r > 0
    a = lora_A.detach().to(weight.dtype).contiguous()  # [r, d_in]
    b = lora_B if lora_B.dtype in (*_HALF, torch.float32) else lora_B.float()
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


def _partials(weight, lora_A, lora_B, scaling, w_sq) -> torch.Tensor:
    """``[n, d_out]`` float32 partial squared row norms of ``W + s B A`` (their column sums are the squared norms,
    ``||W||^2`` included): ``norm_gemm`` for 16-bit ``weight`` (the GEMMs on cuBLAS, one Triton epilogue), the fused
    kernel above for float32, float32-accurate (3-pass TF32). ``w_sq``: a known ``||W||^2``, else computed here."""
    weight = weight if weight.dtype in (*_HALF, torch.float32) else weight.float()  # float64 (references)
    w_sq = weight_sq(weight) if w_sq is None else w_sq
    if weight.dtype in _HALF:
        return norm_half(weight, lora_A, lora_B, scaling, w_sq)
    return _fused_partials(weight, lora_A, lora_B, scaling, w_sq)


def factored_norm_sq(weight, lora_A, lora_B, scaling, w_sq=None) -> torch.Tensor:
    """Triton ``norm_sq_eager``: ``[d_out]`` float32 squared row norms of ``W + s B A``, not clamped.

    ``w_sq``: a known ``||W||^2`` (the norm cache's), else computed here.
    """
    return _partials(weight, lora_A, lora_B, scaling, w_sq).sum(0)


@triton.jit
def _scales_kernel(p_part, p_m, p_norm, p_scales, n_part, d_out, stride_s, FROM_SQ: tl.constexpr, BLOCK: tl.constexpr):
    """norm = sqrt(max(sum of the partial squared norms, 0)) (or the norm itself), then g, g - 1, 1 / norm (rows of
    ``p_scales``, ``stride_s`` apart)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK]
    mask = offs < d_out
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n_part):
        acc += tl.load(p_part + i * d_out + offs, mask=mask, other=0.0)
    if FROM_SQ:
        norm = tl.sqrt_rn(tl.maximum(acc, 0.0))
    else:
        norm = acc
    _store_scales(norm, p_m, p_norm, p_scales, offs, mask, stride_s, BLOCK)


def _outputs(out, d_out: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm, scales)`` to write: ``out``'s, or new ones (``out``: ``None``, a ``[4, d_out]`` buffer, norm then the
    scales, or a ``(norm, scales)`` pair of views, ``[d_out]`` and ``[3, d_out]`` with stride-1 rows)."""
    if type(out) is tuple:
        return out
    if out is None:
        return torch.empty(d_out, dtype=torch.float32, device=device), torch.empty(
            (3, d_out), dtype=torch.float32, device=device
        )
    return out[0], out[1:]


def _finish(part, magnitude, from_sq: bool, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm and the scales from the partial sums ``part``; ``out`` as ``_outputs`` takes it."""
    n_part, d_out = part.shape
    norm, scales = _outputs(out, d_out, part.device)
    m = magnitude.detach().contiguous()
    args = (part, m, norm, scales, n_part, d_out, scales.stride(0))
    launcher.launch_jit(_scales_kernel, (triton.cdiv(d_out, _SCALES_BLOCK),), args, _scales_flags(from_sq))
    return norm, scales


_SCALES_BLOCK = 1024 if not configs.INTERPRETED else 64


def _scales_flags(from_sq: bool) -> dict:
    return dict(FROM_SQ=from_sq, BLOCK=_SCALES_BLOCK)


def norm_and_scales(weight, lora_A, lora_B, scaling, magnitude, out=None, w_sq=None):
    """``(norm, scales)`` in one go: the factored norm finished together with ``ops.norm.scales``.

    Eleven small launches fewer than ``factored_norm_sq`` + clamp + sqrt + ``scales``: what the device machines'
    CPU, not the GPU, pays for at ordinary layer sizes. ``out``: a ``[4, d_out]`` float32
    buffer to write ``norm`` (row 0) and the scales (rows 1-3) into, or a ``(norm, scales)`` pair of views to write.
    ``w_sq``: a known ``||W||^2``. A 16-bit ``weight`` with a rank up to ``norm_small.MAX_R`` takes one launch, two
    where it splits d_in (``kernels/norm_small.py``).
    """
    if norm_small.takes(weight, lora_A):
        w_sq = weight_sq(weight) if w_sq is None else w_sq
        norm, scales = _outputs(out, weight.shape[0], weight.device)
        norm_small.norm_and_scales(weight, lora_A, lora_B, scaling, magnitude, w_sq, norm, scales)
        return norm, scales
    return _finish(_partials(weight, lora_A, lora_B, scaling, w_sq), magnitude, True, out)


def scales_from_norm(magnitude, norm) -> torch.Tensor:
    """``ops.norm.scales(magnitude, norm)`` (float32) in one launch."""
    return _finish(norm.detach().float().reshape(1, -1).contiguous(), magnitude, from_sq=False)[1]


def native_plan(weight, lora_A, lora_B, magnitude) -> tuple | None:
    """What ``flashdora.native``'s ``norm_scales`` needs to compute ``norm_and_scales`` for a layer like this one
    (16-bit ``weight``, one chunk of ``norm_gemm``: the path it takes in C++, the same launches in the same order):
    ``(transposed, BLOCK_J, epilogue's BLOCK_M, its CUfunction, warps, shared, types, kept arguments, then the scales
    kernel's CUfunction, warps, shared, types, kept arguments)``. ``None`` for other layers, and until a Python-path
    call has compiled the kernels and timed the cross term's layout."""
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    if weight.dtype not in _HALF or d_out > norm_gemm._CHUNK_ELEMENTS // r:
        return None
    transposed = norm_gemm._TRANSPOSED.get((d_out, d_in, r, weight.dtype, weight.device))
    if transposed is None:
        return None
    block_j = configs.norm_block_r(r)
    f32 = lora_B.new_empty(1, dtype=torch.float32)  # stand-ins: a plan depends on dtypes and alignment only
    stride_cm, stride_cj = (1, d_out) if transposed else (r, 1)  # C = W a^T as [r, d_out] or [d_out, r]
    epilogue = launcher.direct_plan(
        norm_gemm._epilogue_kernel, (r, lora_B.dtype),
        (f32, lora_B, f32, f32, f32, d_out, r, 1.0, 1.0, stride_cm, stride_cj, lora_B.stride(0), lora_B.stride(1),
         d_out),
        dict(BLOCK_J=block_j),
    )  # fmt: skip
    scales = scales_plan(lora_B, magnitude, triton.cdiv(r, block_j), d_out)
    if epilogue is None or scales is None:
        return None
    config, *epilogue_launch = epilogue
    return (transposed, block_j, config["BLOCK_M"], *epilogue_launch, *scales)


def scales_plan(lora_B, magnitude, n_part: int, d_out: int) -> tuple | None:
    """How C++ launches ``_finish``'s scales kernel on ``n_part`` partial rows of ``d_out`` for layers like this one:
    ``(CUfunction, warps, shared, types, kept arguments)``, or ``None`` until a Python-path call has compiled it."""
    f32 = lora_B.new_empty(1, dtype=torch.float32)  # stand-ins: a plan depends on dtypes and alignment only
    m = lora_B.new_empty(1, dtype=magnitude.dtype)
    got = launcher.jit_plan(_scales_kernel, (f32, m, f32, f32, n_part, d_out, d_out), _scales_flags(True))
    return None if got is None else tuple(got[1:])
