"""DoRA compose forward and backward kernels and their launch wrappers (math: docs/math.md).

Eager twins: ``compose_fwd_eager`` / ``compose_bwd_eager`` in ``ops/compose_fn.py``. Every kernel reads each input
once and writes each output once; the math runs in ``g``'s dtype (float32, or float64 for references).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdora.kernels import configs, launcher
from flashdora.kernels._common import HALF, _to_out


@triton.jit
def _compose_tile(
    b_lora, p_result, p_lx_base, p_bias, p_g, p_gm1, p_y, p_inner,
    offs_m, offs_n, mask_m, mask_n, scaling,
    stride_result, stride_lx_base, stride_y, stride_inner,
    HAS_BIAS: tl.constexpr, HAS_LX_BASE: tl.constexpr, SAVE_INNER: tl.constexpr, ROUND_BASE: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """The compose of one [BLOCK_M, BLOCK_N] tile given its LoRA output ``b_lora``: loads the rest, stores y, inner."""
    mask = mask_m[:, None] & mask_n[None, :]  # [BLOCK_M, BLOCK_N]
    b_g = tl.load(p_g + offs_n, mask=mask_n, other=0.0)  # [BLOCK_N]
    acc = b_g.dtype
    b_result = tl.load(p_result + offs_m[:, None] * stride_result + offs_n[None, :], mask=mask, other=0.0)
    s_lora = b_lora.to(acc) * scaling  # [BLOCK_M, BLOCK_N]
    b_gm1 = tl.load(p_gm1 + offs_n, mask=mask_n, other=0.0)
    b_result = b_result.to(acc)
    if HAS_LX_BASE:
        b_base = tl.load(p_lx_base + offs_m[:, None] * stride_lx_base + offs_n[None, :], mask=mask, other=0.0)
        b_base = b_base.to(acc)
    elif HAS_BIAS:  # PEFT's base_result = result - bias, in their promoted dtype (ROUND_BASE: result's 16 bits)
        b_bias = tl.load(p_bias + offs_n, mask=mask_n, other=0.0).to(acc)
        b_base = b_result - b_bias[None, :]
        if ROUND_BASE:
            b_base = _to_out(b_base, p_y.dtype.element_ty, EMULATE_RNE).to(acc)
    else:
        b_base = b_result
    b_y = b_result + b_gm1[None, :] * b_base + b_g[None, :] * s_lora  # PEFT's form: result + (g - 1) base + g s lora
    b_inner = b_base + s_lora
    p_out = p_y + offs_m[:, None] * stride_y + offs_n[None, :]
    tl.store(p_out, _to_out(b_y, p_y.dtype.element_ty, EMULATE_RNE), mask=mask)
    if SAVE_INNER:
        p_out = p_inner + offs_m[:, None] * stride_inner + offs_n[None, :]
        tl.store(p_out, _to_out(b_inner, p_inner.dtype.element_ty, EMULATE_RNE), mask=mask)


@triton.autotune(configs=configs.COMPOSE_FWD, key=["N"], do_bench=configs.bench)
@triton.jit(do_not_specialize=["T"])
def _compose_fwd_kernel(
    p_result, p_lora, p_lx_base, p_bias, p_scales, p_y, p_inner,
    T, N, scaling,
    stride_result, stride_lora, stride_lx_base, stride_y, stride_inner, stride_scales,
    HAS_BIAS: tl.constexpr, HAS_LX_BASE: tl.constexpr, SAVE_INNER: tl.constexpr, ROUND_BASE: tl.constexpr,
    EMULATE_RNE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of y (and inner); rows are tokens, columns are d_out."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)  # [BLOCK_N]
    mask_m = offs_m < T
    mask_n = offs_n < N
    p_lora_tile = p_lora + offs_m[:, None] * stride_lora + offs_n[None, :]
    b_lora = tl.load(p_lora_tile, mask=mask_m[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_M, BLOCK_N]
    _compose_tile(
        b_lora, p_result, p_lx_base, p_bias, p_scales, p_scales + stride_scales, p_y, p_inner,
        offs_m, offs_n, mask_m, mask_n, scaling,
        stride_result, stride_lx_base, stride_y, stride_inner,
        HAS_BIAS, HAS_LX_BASE, SAVE_INNER, ROUND_BASE, EMULATE_RNE,
    )  # fmt: skip


@triton.autotune(
    configs=configs.COMPOSE_FUSED,
    key=["N", "R"],
    prune_configs_by={"early_config_prune": configs.prune_fused},
    do_bench=configs.bench,
)
@triton.jit(do_not_specialize=["T"])
def _compose_fused_fwd_kernel(
    p_result, p_a, p_lora_B, p_lx_base, p_bias, p_scales, p_y, p_inner,
    T, N, R, scaling,
    stride_result, stride_a, stride_lora_B, stride_lx_base, stride_y, stride_inner, stride_scales,
    HAS_BIAS: tl.constexpr, HAS_LX_BASE: tl.constexpr, SAVE_INNER: tl.constexpr, ROUND_BASE: tl.constexpr,
    EMULATE_RNE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``_compose_fwd_kernel`` with the LoRA output tile computed in place as ``a[rows] @ lora_B[cols]^T`` (K = r)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # [BLOCK_K]
    mask_m = offs_m < T
    mask_n = offs_n < N
    p_ak = p_a + offs_m[:, None] * stride_a + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    p_bk = p_lora_B + offs_k[:, None] + offs_n[None, :] * stride_lora_B  # [BLOCK_K, BLOCK_N], lora_B^T
    b_lora = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, R, BLOCK_K):
        mask_k = (k + offs_k) < R
        b_a = tl.load(p_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b_b = tl.load(p_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        b_b = _to_out(b_b, b_a.dtype, EMULATE_RNE)  # lora_B arrives in its own dtype (fp32 adapters)
        if UPCAST_DOT:  # the 3.9 interpreter multiplies bf16 blocks as raw integers; exact values, fp32 product
            b_lora = tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), b_lora, input_precision=DOT_PRECISION)
        else:
            b_lora = tl.dot(b_a, b_b, b_lora, input_precision=DOT_PRECISION)
        p_ak += BLOCK_K
        p_bk += BLOCK_K
    b_lora = _to_out(b_lora, p_a.dtype.element_ty, EMULATE_RNE)  # rounded like the unfused matmul's output
    _compose_tile(
        b_lora, p_result, p_lx_base, p_bias, p_scales, p_scales + stride_scales, p_y, p_inner,
        offs_m, offs_n, mask_m, mask_n, scaling,
        stride_result, stride_lx_base, stride_y, stride_inner,
        HAS_BIAS, HAS_LX_BASE, SAVE_INNER, ROUND_BASE, EMULATE_RNE,
    )  # fmt: skip


@triton.autotune(configs=configs.COMPOSE_BWD, key=["N"], do_bench=configs.bench)
@triton.jit(do_not_specialize=["T", "rows_per_prog"])
def _compose_bwd_kernel(
    p_dy, p_inner, p_scales, p_gdy, p_d_lx_base, p_dg_part,
    T, N, rows_per_prog, gdy_scale,
    stride_dy, stride_inner, stride_gdy, stride_d_lx_base, stride_scales,
    HAS_INNER: tl.constexpr, HAS_LX_BASE: tl.constexpr, EMULATE_RNE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """(dy gdy_scale) g and (g - 1) dy for rows [pid_s * rows_per_prog, +rows_per_prog), and that range's sum of
    dy * inner / norm (the magnitude gradient's share). ``p_scales``: rows g, g - 1 and 1 / norm, ``stride_scales``
    apart."""
    p_g = p_scales
    p_gm1 = p_scales + stride_scales
    pid_s = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)  # [BLOCK_N]
    mask_n = offs_n < N
    b_g = tl.load(p_g + offs_n, mask=mask_n, other=0.0)  # [BLOCK_N]
    b_gm1 = tl.load(p_gm1 + offs_n, mask=mask_n, other=0.0)
    acc = b_g.dtype
    b_dg = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc)
    row_start = pid_s * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, T)
    for start in range(0, rows_per_prog, BLOCK_M):
        offs_m = row_start + start + tl.arange(0, BLOCK_M).to(tl.int64)  # [BLOCK_M]
        mask = (offs_m < row_end)[:, None] & mask_n[None, :]  # [BLOCK_M, BLOCK_N]
        b_dy = tl.load(p_dy + offs_m[:, None] * stride_dy + offs_n[None, :], mask=mask, other=0.0).to(acc)
        b_gdy = (b_dy * gdy_scale) * b_g[None, :]  # PEFT's order: the grad of (g lora) s
        p_out = p_gdy + offs_m[:, None] * stride_gdy + offs_n[None, :]
        tl.store(p_out, _to_out(b_gdy, p_gdy.dtype.element_ty, EMULATE_RNE), mask=mask)
        if HAS_LX_BASE:
            b_dlb = b_gm1[None, :] * b_dy
            p_out = p_d_lx_base + offs_m[:, None] * stride_d_lx_base + offs_n[None, :]
            tl.store(p_out, _to_out(b_dlb, p_d_lx_base.dtype.element_ty, EMULATE_RNE), mask=mask)
        if HAS_INNER:
            b_inner = tl.load(p_inner + offs_m[:, None] * stride_inner + offs_n[None, :], mask=mask, other=0.0)
            b_dg += b_dy * b_inner.to(acc)
    if HAS_INNER:
        b_inv = tl.load(p_scales + 2 * stride_scales + offs_n, mask=mask_n, other=0.0)
        tl.store(p_dg_part + pid_s * N + offs_n, tl.sum(b_dg, axis=0) * b_inv, mask=mask_n)


def _rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """``(tensor, row stride)`` for a kernel that reads ``t`` as ``[tokens, n]`` rows with stride-1 columns: ``t``
    itself when contiguous (no reshape call on the host path), else a 2-D view when the strides allow, else a copy."""
    if t.is_contiguous():
        return t, n
    t2 = t.reshape(-1, n)
    t2 = t2 if t2.stride(1) == 1 else t2.contiguous()
    return t2, t2.stride(0)


def _empty_rows(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor shaped and typed like ``t`` (``empty_like`` parses no size: cheaper on the
    host than ``torch.empty`` with a shape; docs/host-notes.md)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# Elements of lora_B from which the fused forward gets it cast to the matmul dtype first, in one pass, rather than in
# the kernel's registers: past it the GPU time saved outweighs one more launch (docs/host-notes.md;
# native/csrc/compose.h takes it at load: ``kCastBFirst``).
CAST_B_FIRST = 8 * 2**20
# Tokens x elements of lora_B from which it is cast first at any size (above the small-rank tile's ranks): each of
# the kernel's row tiles re-reads its columns of lora_B, so past a few row tiles the float32 reads cost more than one
# cast pass, and the 16-bit operand takes the faster tile (configs.prune_fused; docs/kernels.md, "Tiles").
CAST_B_WORK = 2**31


def cast_b_first(lora_B: torch.Tensor, t: int) -> bool:
    """Whether the fused forward over ``t`` tokens gets ``lora_B`` cast to the matmul dtype in one pass first,
    rather than in its registers (``native/csrc/compose.h`` ``cast_b_first`` is its C++ twin)."""
    n = lora_B.numel()
    return n >= CAST_B_FIRST or (t * n >= CAST_B_WORK and lora_B.shape[-1] > configs.FUSED_SMALL_R)


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)  # (``triton.cdiv`` is a ConstexprFunction in recent Triton: several Python calls on the host)


# The wrappers below run once per layer call on the host, which is the bottleneck at ordinary layer sizes: they do
# no checks (ops/ validates) and as few torch calls as they can (outputs are allocated in their final shape).


def _fwd_io(result, scales, bias, lx_base, save_inner):
    """Shared forward plumbing: row views, optional-input stand-ins, the (y, inner) outputs and the flags."""
    n = result.shape[-1]
    t = result.numel() // n if n > 0 else 0
    res2, stride_res = _rows(result, n)
    has_lx_base = lx_base is not None
    has_bias = bias is not None and not has_lx_base
    lb2, stride_lb = _rows(lx_base, n) if has_lx_base else (res2, stride_res)
    bias_c = bias.contiguous() if has_bias else scales
    y = _empty_rows(result)
    inner = _empty_rows(result) if save_inner else y
    # PEFT's result - bias rounds to result's dtype when torch promotes the pair to it (a 16-bit layer's own bias)
    round_base = has_bias and result.dtype in HALF and bias.dtype == result.dtype
    flags = dict(
        HAS_BIAS=has_bias, HAS_LX_BASE=has_lx_base, SAVE_INNER=save_inner, ROUND_BASE=round_base,
        EMULATE_RNE=configs.INTERPRETED,
    )  # fmt: skip
    return t, n, (res2, stride_res), (lb2, stride_lb), bias_c, y, inner, flags


def _grid_2d(t: int, n: int):
    return lambda meta: (_cdiv(t, meta["BLOCK_M"]), _cdiv(n, meta["BLOCK_N"]))


def compose_fwd(result, lora, scales, scaling, bias=None, lx_base=None, save_inner=True):
    """Triton ``compose_fwd_eager``: ``(y, inner or None)``, both shaped and typed like ``result``.

    ``scales``: rows ``g`` and ``g - 1`` (more rows may follow, e.g. ``1 / norm``), each contiguous.
    """
    t, n, (res2, s_res), (lb2, s_lb), bias_c, y, inner, flags = _fwd_io(result, scales, bias, lx_base, save_inner)
    lora2, s_lora = _rows(lora, n)
    if t > 0 and n > 0:
        args = (
            res2, lora2, lb2, bias_c, scales, y, inner,
            t, n, float(scaling),
            s_res, s_lora, s_lb, n, n, scales.stride(0),
        )  # fmt: skip
        key = (n, result.dtype, lora.dtype, lb2.dtype, bias_c.dtype, scales.dtype)
        launcher.launch(_compose_fwd_kernel, _grid_2d(t, n), key, args, flags)
    return y, inner if save_inner else None


def compose_fwd_fused(result, a, lora_B, scales, scaling, bias=None, lx_base=None, save_inner=True):
    """``compose_fwd(result, a @ lora_B^T, ...)`` with the LoRA B matmul inside the kernel (never written out).

    ``a``: ``[..., r]`` (the LoRA A output); ``lora_B``: ``[d_out, r]`` in any float dtype, rounded to ``a``'s
    dtype in registers as the eager matmul's cast would (no cast pass). The LoRA tile is rounded to ``a``'s dtype
    before the compose, as PEFT's (and the eager path's) matmul output is: same values, so a flashdora model tracks
    PEFT's under bf16.
    """
    t, n, y, inner, launch = _fused_call(result, a, lora_B, scales, scaling, bias, lx_base, save_inner)
    if t > 0 and n > 0:
        launcher.launch(_compose_fused_fwd_kernel, _grid_2d(t, n), *launch)
    return y, inner if save_inner else None


def _fused_call(result, a, lora_B, scales, scaling, bias, lx_base, save_inner):
    """``(t, n, y, inner, (key, args, flags))``: the fused forward's outputs and its launch arguments."""
    r = a.shape[-1]
    t, n, (res2, s_res), (lb2, s_lb), bias_c, y, inner, flags = _fwd_io(result, scales, bias, lx_base, save_inner)
    a2, s_a = _rows(a, r)
    b = lora_B if lora_B.stride(1) == 1 else lora_B.contiguous()
    args = (
        res2, a2, b, lb2, bias_c, scales, y, inner,
        t, n, r, float(scaling),
        s_res, s_a, b.stride(0), s_lb, n, n, scales.stride(0),
    )  # fmt: skip
    flags["DOT_PRECISION"] = "tf32x3" if a.dtype == torch.float32 else "tf32"
    flags["UPCAST_DOT"] = configs.INTERPRETED and a.dtype == torch.bfloat16
    key = (n, r, result.dtype, a.dtype, b.dtype, lb2.dtype, bias_c.dtype, scales.dtype)
    return t, n, y, inner, (key, args, flags)


def compose_bwd(dy, inner, scales, has_lx_base, gdy_scale=1.0):
    """Triton ``compose_bwd_eager``: ``((dy gdy_scale) g, (g - 1) dy or None, sum_tokens dy * inner / norm or None)``.

    ``scales``: ``[3, d_out]`` rows ``(g, g - 1, 1 / norm)``, each contiguous. The magnitude gradient is
    deterministic: each program writes its own token range's partial sum to a ``[n_splits, d_out]`` buffer, and
    ``torch.sum`` adds the rows in a fixed order.
    """
    n = dy.shape[-1]
    t = dy.numel() // n if n > 0 else 0
    dy2, s_dy = _rows(dy, n)
    inner2, s_inner = _rows(inner, n) if inner is not None else (dy2, s_dy)
    gdy = _empty_rows(dy)
    d_lx_base = _empty_rows(dy) if has_lx_base else gdy
    rows_per_prog, like_part = _bwd_split(t, n, scales)  # like_part: [n_split, d_out]
    n_split = like_part.shape[0]
    dg_part = torch.empty_like(like_part) if inner is not None else scales
    if t > 0 and n > 0:
        args = (
            dy2, inner2, scales, gdy, d_lx_base, dg_part,
            t, n, rows_per_prog, float(gdy_scale),
            s_dy, s_inner, n, n, scales.stride(0),
        )  # fmt: skip
        flags = dict(HAS_INNER=inner is not None, HAS_LX_BASE=has_lx_base, EMULATE_RNE=configs.INTERPRETED)
        grid = lambda meta: (n_split, _cdiv(n, meta["BLOCK_N"]))  # noqa: E731
        launcher.launch(_compose_bwd_kernel, grid, (n, dy.dtype, inner2.dtype, scales.dtype), args, flags)
    dg = None
    if inner is not None:
        if n_split == 1:
            dg = dg_part[0]
        else:
            dg = dg_part.sum(0) if n_split > 0 else torch.zeros(n, dtype=scales.dtype, device=dy.device)
    return gdy, d_lx_base if has_lx_base else None, dg


_BWD_SPLIT: dict[tuple, tuple] = {}


def _bwd_split(t: int, n: int, scales: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``(tokens per backward program, a stand-in shaped like the partial-sum buffer)`` for ``t`` tokens. The token
    range is a multiple of every BLOCK_M, sized for ``configs.COMPOSE_BWD_TARGET_PROGRAMS_PER_SM`` programs an SM;
    the stand-in is one element expanded to ``[n_split, d_out]``, so ``torch.empty_like`` of it allocates the buffer
    cheaply on the host."""
    key = (t, n, scales.dtype, scales.device)
    hit = _BWD_SPLIT.get(key)
    if hit is not None:
        return hit
    q = configs.COMPOSE_BWD_ROW_QUANTUM
    sms = configs.sm_count(scales.device)
    target = sms * configs.COMPOSE_BWD_TARGET_PROGRAMS_PER_SM
    col_blocks = _cdiv(n, configs.COMPOSE_BWD_MIN_COL_BLOCK)
    n_split = max(1, _cdiv(target, col_blocks))
    rows = max(q, _cdiv(_cdiv(t, n_split), q) * q)
    like = scales.new_empty(1).expand(_cdiv(t, rows) if t > 0 else 0, n)
    hit = _BWD_SPLIT[key] = (rows, like)
    return hit
