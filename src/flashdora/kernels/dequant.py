"""A bitsandbytes 8-bit weight (``Int8Params``: ``CB`` int8 rows, ``SCB`` float32 row scales) dequantized to a
16-bit dtype in one pass: bitsandbytes' ``int8_vectorwise_dequant`` arithmetic (``CB * SCB * scale`` in float32, in
that order; ``scale`` is its 1/127, ``quant.dequant._INT8_SCALE``), rounded once to the output dtype. The same bits as
that function's float32 result cast, without the float32 ``[d_out, d_in]`` tensor (or its row chunks) and with one
launch: a norm cache miss on an 8-bit base runs it once per layer and optimizer step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdora.kernels import launcher
from flashdora.kernels._common import HALF, _to_out
from flashdora.kernels.configs import INTERPRETED

_BLOCK_M, _BLOCK_N = (8, 512) if not INTERPRETED else (4, 16)


@triton.jit
def _int8_kernel(p_cb, p_scb, p_out, d_out, d_in, SCALE: tl.constexpr, EMULATE_RNE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile: ``(float(CB) * SCB[row]) * SCALE``, rounded to the output's dtype."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_m = offs_m < d_out
    mask = mask_m[:, None] & (offs_n < d_in)[None, :]
    offs = offs_m[:, None] * d_in + offs_n[None, :]
    cb = tl.load(p_cb + offs, mask=mask, other=0).to(tl.float32)
    scb = tl.load(p_scb + offs_m, mask=mask_m, other=0.0)
    w = (cb * scb[:, None]) * SCALE
    tl.store(p_out + offs, _to_out(w, p_out.dtype.element_ty, EMULATE_RNE), mask=mask)


def takes(data: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``int8_to`` dequantizes these: a contiguous 2-D int8 ``data``, float32 row scales on its device, a
    16-bit ``dtype``."""
    return (
        dtype in HALF and data.dtype == torch.int8 and data.dim() == 2
        and data.is_contiguous() and scb.dtype == torch.float32 and scb.device == data.device
        and scb.numel() == data.shape[0]
    )  # fmt: skip


def int8_to(data: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """One launch of ``(data * scb[:, None] * scale).to(dtype)`` (float32 products); ``takes`` must hold."""
    d_out, d_in = data.shape
    out = torch.empty((d_out, d_in), dtype=dtype, device=data.device)
    grid = (triton.cdiv(d_out, _BLOCK_M), triton.cdiv(d_in, _BLOCK_N))
    flags = dict(SCALE=scale, EMULATE_RNE=INTERPRETED, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N)
    launcher.launch_jit(_int8_kernel, grid, (data, scb.contiguous(), out, d_out, d_in), flags)
    return out
