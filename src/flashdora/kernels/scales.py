"""The finish of every norm kernel: the partial squared norms summed in a fixed order, then DoRA's scales.

``_scales_kernel`` adds ``[n, d_out]`` partial rows (``norm_gemm``'s slices, ``norm_fp32``'s, ``norm_small``'s
splits of d_in), takes the square root and writes ``norm`` and the scales ``g = m / norm``, ``g - 1``, ``1 / norm``
(``_common._store_scales``); from a known norm it writes the scales only (``scales_from_norm``). Eager twin:
``scales`` in ``ops/norm.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdora.kernels import configs, launcher
from flashdora.kernels._common import _store_scales


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


def outputs(out, d_out: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm, scales)`` to write: ``out``'s, or new ones (``out``: ``None``, a ``[4, d_out]`` buffer, norm then the
    scales, or a ``(norm, scales)`` pair of views, ``[d_out]`` and ``[3, d_out]`` with stride-1 rows)."""
    if type(out) is tuple:
        return out
    if out is None:
        return torch.empty(d_out, dtype=torch.float32, device=device), torch.empty(
            (3, d_out), dtype=torch.float32, device=device
        )
    return out[0], out[1:]


def finish(part, magnitude, from_sq: bool, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm and the scales from the partial sums ``part``; ``out`` as ``outputs`` takes it."""
    n_part, d_out = part.shape
    norm, scales = outputs(out, d_out, part.device)
    m = magnitude.detach().contiguous()
    args = (part, m, norm, scales, n_part, d_out, scales.stride(0))
    launcher.launch_jit(_scales_kernel, (triton.cdiv(d_out, _SCALES_BLOCK),), args, _scales_flags(from_sq))
    return norm, scales


SCALES_BLOCK = 1024  # (native/csrc/norm.cpp: kScalesBlock)
_SCALES_BLOCK = SCALES_BLOCK if not configs.INTERPRETED else 64


def _scales_flags(from_sq: bool) -> dict:
    return dict(FROM_SQ=from_sq, BLOCK=_SCALES_BLOCK)


def scales_from_norm(magnitude, norm) -> torch.Tensor:
    """``ops.norm.scales(magnitude, norm)`` (float32) in one launch."""
    return finish(norm.detach().float().reshape(1, -1).contiguous(), magnitude, from_sq=False)[1]
