"""Triton helpers the kernel files share: the rounding to an output dtype, the scales' store, the Gram term.

Nothing here launches; each helper is inlined into the kernels that call it (``compose``, ``dequant``,
``norm_small``, ``norm_gemm``, ``norm_fp32``, ``scales``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HALF = (torch.float16, torch.bfloat16)  # the 16-bit dtypes: the ones the half-precision paths take


@triton.jit
def _to_out(x, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """``x.to(DTYPE)``; with EMULATE_RNE (set only under the CPU interpreter, which truncates fp32 -> bf16 as of
    Triton 3.9), rounds fp32 -> bf16 to nearest even by hand, as the GPU does."""
    if EMULATE_RNE and DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _store_scales(norm, p_m, p_norm, p_scales, offs, mask, stride_s, BLOCK: tl.constexpr):
    """``norm`` and DoRA's scales ``g = m / norm``, ``g - 1 = (m - norm) / norm``, ``1 / norm`` (rows of
    ``p_scales``, ``stride_s`` apart); a zero norm gives ``0, -1, 0`` (``ops.norm.scales``)."""
    m = tl.load(p_m + offs, mask=mask, other=0.0).to(tl.float32)
    positive = norm > 0.0
    inv = tl.where(positive, tl.div_rn(tl.full([BLOCK], 1.0, tl.float32), tl.where(positive, norm, 1.0)), 0.0)
    gm1 = tl.where(positive, (m - norm) * inv, -1.0)
    tl.store(p_norm + offs, norm, mask=mask)
    tl.store(p_scales + offs, m * inv, mask=mask)
    tl.store(p_scales + stride_s + offs, gm1, mask=mask)
    tl.store(p_scales + 2 * stride_s + offs, inv, mask=mask)


@triton.jit
def _gram_term(
    acc, p_b, p_gram, offs_m, offs_j, mask_m, mask_j, r, stride_bm, stride_br, b_scale,
    SCALE_B: tl.constexpr, PRECISION: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """``acc + B[rows] @ G[:, slice]`` (``B`` times ``b_scale`` when ``SCALE_B``), a plain GEMM loop over K = r: the
    Gram term of both norm kernels (``norm_gemm``'s epilogue, and ``norm_fp32``'s fused kernel)."""
    offs_g = tl.arange(0, BLOCK_G).to(tl.int64)  # [BLOCK_G]
    p_bk = p_b + offs_m[:, None] * stride_bm + offs_g[None, :] * stride_br  # [BLOCK_M, BLOCK_G]
    p_gk = p_gram + offs_g[:, None] * r + offs_j[None, :]  # [BLOCK_G, BLOCK_J]
    for k in range(0, r, BLOCK_G):
        mask_k = (k + offs_g) < r
        b_b = tl.load(p_bk, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        if SCALE_B:
            b_b = b_b * b_scale
        b_g = tl.load(p_gk, mask=mask_k[:, None] & mask_j[None, :], other=0.0)
        acc = tl.dot(b_b, b_g, acc, input_precision=PRECISION)
        p_bk += BLOCK_G * stride_br
        p_gk += BLOCK_G * r
    return acc
