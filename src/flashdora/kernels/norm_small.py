"""A 16-bit weight's norm and DoRA's scales for a small rank in one or two launches: a cache miss of few host steps.

``||W + s B A||^2 = ||W||^2 + 2s <W a^T, B>_row + s^2 <B G, B>_row`` with ``a = A`` rounded to W's dtype and
``G = a a^T`` (docs/math.md), as ``norm_gemm`` computes it, but for ``r <= MAX_R`` in one kernel: each program owns
``BLOCK_M`` rows, streams its rows of ``W`` once with the tiles of ``A`` (cast in registers, the rounding of
``A.to(W.dtype)``), accumulates its ``C = W_rows a^T`` and the whole ``G`` (``r x r``, recomputed by every program:
as much work as its rows' cross term once ``BLOCK_M >= r``, which bounds the rank) on the tensor cores, then
finishes the row norm and the scales. No ``[d_out, r]`` product and no ``G`` reach memory, and a miss is one launch
(two where it splits d_in, below) instead of ``norm_gemm``'s cast, two cuBLAS calls and two launches, which cost
host time every layer and optimizer step (docs/host-notes.md). Larger ranks take ``norm_gemm``,
whose cuBLAS GEMM runs the cross term faster than a Triton one once it is not bound by reading ``W``.

A layer with few row blocks (``d_out / BLOCK_M`` programs could not fill the GPU: the 8B shapes' k/v projections
have 16) also splits d_in (``split``): grid ``(row blocks, splits)``, each program its rows' partial squared norm
over its columns into a ``[splits, d_out]`` buffer, then ``scales._scales_kernel`` adds the partials in a fixed order
and writes the norm and the scales (two launches, no atomics, the same bits on every run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdora.kernels import configs, launcher
from flashdora.kernels._common import HALF, _store_scales, _to_out
from flashdora.kernels.scales import finish

MAX_R = 64  # the largest rank this kernel takes (its accumulators: [BLOCK_M, r] and [r, r] float32 per program)
# Splitting d_in: aim at PROGRAMS_PER_SM programs a multiprocessor (counting row blocks of SPLIT_BLOCK_M rows), each
# but the last streaming at least MIN_CHUNK columns, chunks a multiple of CHUNK_ALIGN (every BLOCK_K; 16-byte aligned
# rows).
PROGRAMS_PER_SM = 4
SPLIT_BLOCK_M = 64
MIN_CHUNK = 512 if not configs.INTERPRETED else 16
CHUNK_ALIGN = 128 if not configs.INTERPRETED else 16


@triton.autotune(
    configs=configs.NORM_SMALL,
    key=["d_out", "d_in", "r"],
    prune_configs_by={"early_config_prune": configs.prune_small},
    do_bench=configs.bench,
)
@triton.jit
def _small_kernel(
    p_w, p_a, p_b, p_wsq, p_m, p_norm, p_scales, p_part,
    d_out, d_in, r, two_s, s_sq, chunk,
    stride_wm, stride_wk, stride_ar, stride_ak, stride_bm, stride_br, stride_s,
    INTERPRETED: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """BLOCK_M rows (grid x) and ``chunk`` columns (grid y): ``C = W_rows a^T`` and ``G = a a^T`` over the columns,
    then ``<2s C + s^2 B G, B>`` per row; with ``||W||^2``, its square root and the scales (one chunk), or
    (``PARTIAL``) the sum (plus ``||W||^2`` in chunk 0) into row ``chunk index`` of ``p_part``."""
    pid = tl.program_id(0).to(tl.int64)
    k_lo = tl.program_id(1).to(tl.int64) * chunk
    k_hi = tl.minimum(k_lo + chunk, d_in)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # [BLOCK_M]
    offs_r = tl.arange(0, BLOCK_R).to(tl.int64)  # [BLOCK_R]
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # [BLOCK_K]
    mask_m = offs_m < d_out
    mask_r = offs_r < r
    p_wk = p_w + offs_m[:, None] * stride_wm + (k_lo + offs_k)[None, :] * stride_wk  # [BLOCK_M, BLOCK_K]
    p_ak = p_a + offs_r[:, None] * stride_ar + (k_lo + offs_k)[None, :] * stride_ak  # [BLOCK_R, BLOCK_K]
    acc_c = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        mask_k = (k + offs_k) < k_hi
        b_w = tl.load(p_wk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b_a = tl.load(p_ak, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        b_a = _to_out(b_a, p_w.dtype.element_ty, INTERPRETED)  # (the interpreter truncates; this rounds to nearest)
        b_at = tl.trans(b_a)  # [BLOCK_K, BLOCK_R]
        if INTERPRETED:  # the 3.9 interpreter multiplies 16-bit blocks as raw integers; exact values in float32
            b_w = b_w.to(tl.float32)
            b_a = b_a.to(tl.float32)
            b_at = b_at.to(tl.float32)
            acc_c = tl.dot(b_w, b_at, acc_c, input_precision="ieee")
            acc_g = tl.dot(b_a, b_at, acc_g, input_precision="ieee")
        else:  # 16-bit operands: exact products, float32 sums
            acc_c = tl.dot(b_w, b_at, acc_c)
            acc_g = tl.dot(b_a, b_at, acc_g)
        p_wk += BLOCK_K * stride_wk
        p_ak += BLOCK_K * stride_ak
    p_bm = p_b + offs_m[:, None] * stride_bm + offs_r[None, :] * stride_br
    b_b = tl.load(p_bm, mask=mask_m[:, None] & mask_r[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_R]
    # B G in three TF32 passes (float32-accurate): one TF32 pass would round each split's partial G its own way
    bg = tl.dot(b_b, acc_g, input_precision="tf32x3")
    sq = tl.sum((two_s * acc_c + s_sq * bg) * b_b, axis=1)
    if PARTIAL:
        sq += tl.where(k_lo == 0, tl.load(p_wsq + offs_m, mask=mask_m, other=0.0), 0.0)
        tl.store(p_part + tl.program_id(1).to(tl.int64) * d_out + offs_m, sq, mask=mask_m)
    else:
        sq += tl.load(p_wsq + offs_m, mask=mask_m, other=0.0)
        norm = tl.sqrt_rn(tl.maximum(sq, 0.0))
        _store_scales(norm, p_m, p_norm, p_scales, offs_m, mask_m, stride_s, BLOCK_M)


def takes(weight: torch.Tensor, lora_A: torch.Tensor) -> bool:
    """Whether ``norm_and_scales`` runs this kernel for a 16-bit ``weight`` and this rank."""
    return weight.dtype in HALF and lora_A.shape[0] <= MAX_R and lora_A.dtype in (*HALF, torch.float32)


def split(weight: torch.Tensor) -> tuple[int, int]:
    """``(splits, chunk)``: how many column ranges of ``chunk`` columns the kernel splits ``weight``'s d_in into
    (``(1, d_in)``: none). Enough programs for ``PROGRAMS_PER_SM`` a multiprocessor, every range but the last at
    least ``MIN_CHUNK`` columns; a function of the shape and the device only, so every call of a layer adds its
    partial sums in the same order."""
    return _split(*weight.shape, configs.sm_count(weight.device))


def _split(d_out: int, d_in: int, sms: int) -> tuple[int, int]:
    if d_out == 0:
        return 1, d_in
    want = triton.cdiv(PROGRAMS_PER_SM * sms, triton.cdiv(d_out, SPLIT_BLOCK_M))
    splits = max(1, min(want, d_in // MIN_CHUNK))
    if splits == 1:
        return 1, d_in
    chunk = triton.cdiv(triton.cdiv(d_in, splits), CHUNK_ALIGN) * CHUNK_ALIGN
    splits = triton.cdiv(d_in, chunk)
    return (1, d_in) if splits == 1 else (splits, chunk)


def block_r(r: int) -> int:
    """The kernel's BLOCK_R: next_pow2(r), at least 16 (``tl.dot``'s smallest operand)."""
    return max(16, triton.next_power_of_2(r))


def _flags(r: int, partial: bool) -> dict:
    return dict(INTERPRETED=configs.INTERPRETED, PARTIAL=partial, BLOCK_R=block_r(r))


def _args(weight, lora_A, lora_B, w_sq, m, norm, scales, part, scaling: float, chunk: int) -> tuple:
    d_out, d_in = weight.shape
    return (
        weight, lora_A, lora_B, w_sq, m, norm, scales, part,
        d_out, d_in, lora_A.shape[0], 2.0 * scaling, scaling * scaling, chunk,
        weight.stride(0), weight.stride(1), lora_A.stride(0), lora_A.stride(1), lora_B.stride(0), lora_B.stride(1),
        scales.stride(0),
    )  # fmt: skip


def _key(weight, lora_A, lora_B, m) -> tuple:
    """What the tuned config and the compiled kernel depend on: the autotuner's key and every tensor's dtype."""
    d_out, d_in = weight.shape
    return (d_out, d_in, lora_A.shape[0], weight.dtype, lora_A.dtype, lora_B.dtype, m.dtype)


def norm_and_scales(weight, lora_A, lora_B, scaling: float, magnitude, w_sq, norm, scales, splits=None) -> None:
    """Writes the norm ``[d_out]`` and the scales ``[3, d_out]`` (stride-1 rows) of ``W + s B A`` into ``norm`` and
    ``scales`` (float32); ``w_sq``: ``||W||^2`` float32. For ``takes(weight, lora_A)``. ``splits``: ``split``'s
    ``(splits, chunk)`` (tests pass others)."""
    lora_A, lora_B = lora_A.detach(), lora_B.detach()
    lora_B = lora_B if lora_B.dtype in (*HALF, torch.float32) else lora_B.float()
    m = magnitude.detach().contiguous()
    n_split, chunk = split(weight) if splits is None else splits
    part = norm if n_split == 1 else torch.empty((n_split, weight.shape[0]), dtype=torch.float32, device=norm.device)
    args = _args(weight, lora_A, lora_B, w_sq, m, norm, scales, part, scaling, chunk)
    grid = lambda meta: (triton.cdiv(weight.shape[0], meta["BLOCK_M"]), n_split)  # noqa: E731
    launcher.launch(_small_kernel, grid, _key(weight, lora_A, lora_B, m), args, _flags(lora_A.shape[0], n_split > 1))
    if n_split > 1:
        finish(part, m, True, (norm, scales))
