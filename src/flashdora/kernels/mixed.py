"""The mixed-adapter compose: one launch per projection for a batch whose requests use different adapters.

Each request (a row of the batch, ``L`` tokens) has a slot: 0 for the base model, ``k`` for the pack's k-th adapter.
The LoRA A outputs of every adapter sit side by side in ``u`` (``[tokens, R]``, ``R`` the adapters' summed ranks,
from one matmul against the stacked A); a column belongs to one slot (``col_slot``). The kernel keeps, for each
token, only its own adapter's columns, times that adapter's scaling, multiplies by the stacked B (``[d_out, R]``),
and composes with its slot's DoRA scales: ``y = result + (g - 1) base + g s B A x`` (PEFT's form; a LoRA adapter's
and the base's slot has ``g = 1``, ``g - 1 = 0``). Eager twin: ``ops.mixed.mixed_eager``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdora.kernels import configs, launcher
from flashdora.kernels._common import HALF, _to_out
from flashdora.kernels.compose import _cdiv, _empty_rows, _rows


@triton.autotune(
    configs=configs.MIXED_FWD,
    key=["N", "R"],
    prune_configs_by={"early_config_prune": configs.prune_mixed},
    do_bench=configs.bench,
)
@triton.jit(do_not_specialize=["T", "L"])
def _mixed_fwd_kernel(
    p_result, p_u, p_lora_B, p_bias, p_scales, p_row_slot, p_col_slot, p_col_scale, p_y,
    T, N, R, L,
    stride_result, stride_u, stride_lora_B, stride_y, stride_slot,
    HAS_BIAS: tl.constexpr, ROUND_BASE: tl.constexpr, EMULATE_RNE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of y: rows are tokens (``L`` per request), columns d_out. ``p_scales``:
    ``[slots, 2, N]`` (g, g - 1), ``stride_slot`` apart."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # [BLOCK_K]
    mask_m = offs_m < T
    mask_n = offs_n < N
    slot = tl.load(p_row_slot + offs_m // L, mask=mask_m, other=0)  # [BLOCK_M]: the token's request's slot
    p_uk = p_u + offs_m[:, None] * stride_u + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    p_bk = p_lora_B + offs_k[:, None] + offs_n[None, :] * stride_lora_B  # [BLOCK_K, BLOCK_N], lora_B^T
    b_lora = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, R, BLOCK_K):
        mask_k = (k + offs_k) < R
        col_slot = tl.load(p_col_slot + k + offs_k, mask=mask_k, other=-1)  # [BLOCK_K]
        col_scale = tl.load(p_col_scale + k + offs_k, mask=mask_k, other=0.0)
        b_u = tl.load(p_uk, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        b_u = tl.where(slot[:, None] == col_slot[None, :], b_u * col_scale[None, :], 0.0)  # its own adapter's columns
        b_b = tl.load(p_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        b_lora = tl.dot(b_u, b_b, b_lora, input_precision=DOT_PRECISION)
        p_uk += BLOCK_K
        p_bk += BLOCK_K
    mask = mask_m[:, None] & mask_n[None, :]
    p_g = p_scales + slot[:, None].to(tl.int64) * stride_slot + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
    b_g = tl.load(p_g, mask=mask, other=0.0)
    b_gm1 = tl.load(p_g + N, mask=mask, other=0.0)
    b_result = tl.load(p_result + offs_m[:, None] * stride_result + offs_n[None, :], mask=mask, other=0.0)
    b_result = b_result.to(tl.float32)
    if HAS_BIAS:  # PEFT's base_result = result - bias (ROUND_BASE: in result's 16 bits)
        b_bias = tl.load(p_bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        b_base = b_result - b_bias[None, :]
        if ROUND_BASE:
            b_base = _to_out(b_base, p_y.dtype.element_ty, EMULATE_RNE).to(tl.float32)
    else:
        b_base = b_result
    b_y = b_result + b_gm1 * b_base + b_g * b_lora
    p_out = p_y + offs_m[:, None] * stride_y + offs_n[None, :]
    tl.store(p_out, _to_out(b_y, p_y.dtype.element_ty, EMULATE_RNE), mask=mask)


def mixed_fwd(result, u, lora_B, scales, row_slot, col_slot, col_scale, bias=None):
    """Triton ``ops.mixed.mixed_eager``: ``y`` shaped and typed like ``result`` (``[B, ..., d_out]``).

    ``u``: ``[B, ..., R]``, the stacked A's output; ``lora_B``: ``[d_out, R]``; ``scales``: ``[slots, 2, d_out]``
    float32; ``row_slot``: ``[B]`` int32; ``col_slot``, ``col_scale``: ``[R]``; ``bias``: ``[d_out]`` or ``None``.
    """
    n = result.shape[-1]
    r = u.shape[-1]
    t = result.numel() // n if n > 0 else 0
    res2, s_res = _rows(result, n)
    u2, s_u = _rows(u, r)
    b = lora_B if lora_B.stride(1) == 1 else lora_B.contiguous()
    y = _empty_rows(result)
    if t == 0 or n == 0:
        return y
    rows = t // row_slot.shape[0]  # tokens per request
    has_bias = bias is not None
    flags = dict(
        HAS_BIAS=has_bias, ROUND_BASE=has_bias and result.dtype in HALF and bias.dtype == result.dtype,
        EMULATE_RNE=configs.INTERPRETED, DOT_PRECISION="ieee" if result.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    bias_c = bias.contiguous() if has_bias else scales
    args = (
        res2, u2, b, bias_c, scales, row_slot, col_slot, col_scale, y,
        t, n, r, rows,
        s_res, s_u, b.stride(0), n, scales.stride(0),
    )  # fmt: skip
    key = (n, r, t <= configs.MIXED_DECODE_TOKENS, result.dtype, u.dtype, b.dtype, bias_c.dtype)
    grid = lambda meta: (_cdiv(t, meta["BLOCK_M"]), _cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    launcher.launch(_mixed_fwd_kernel, grid, key, args, flags)
    return y
