"""``dora_linear`` and the DoRA compose op: public function, autograd boundary, eager forward and backward.

The op takes the base layer's output (``result = x W^T + bias``, as PEFT hands it to its variants) and adds the
DoRA delta with the LoRA matmuls inside, so the Triton path can fuse the compose into them. Math: docs/math.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashdora import _checks, backend
from flashdora.ops.norm import norm_from_parts


def scales(magnitude: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``g = m / norm``, ``g - 1 = (m - norm) / norm`` and ``1 / norm``, in float32 (float64 for float64 inputs).

    A row with ``norm == 0`` (its W row and LoRA delta are both zero) gets ``g = 0``, ``g - 1 = -1`` and
    ``1 / norm = 0``: it outputs its bias and gets a zero magnitude gradient, never NaN.
    """
    acc = torch.promote_types(magnitude.dtype, torch.float32)
    m, n = magnitude.detach().to(acc), norm.detach().to(acc)
    positive = n > 0
    inv = torch.where(positive, 1.0 / n, torch.zeros_like(n))
    g = m * inv
    gm1 = torch.where(positive, (m - n) * inv, torch.full_like(n, -1.0))
    return g, gm1, inv


def compose_fwd_eager(result, lora, g, gm1, scaling, bias=None, lx_base=None, save_inner=True):
    """Eager twin of ``kernels.compose.compose_fwd``: ``(y, inner)`` in ``result.dtype``, fp32 math."""
    acc = g.dtype
    if lx_base is None:
        inner = result.to(acc, copy=True)
        if bias is not None:
            inner -= bias.to(acc)
        inner.add_(lora.to(acc), alpha=scaling)
        y = inner * g
        if bias is not None:
            y += bias.to(acc)
    else:
        lb = lx_base.to(acc)
        s_lora = lora.to(acc) * scaling
        y = result.to(acc) + gm1 * lb + g * s_lora
        inner = s_lora.add_(lb)
    return y.to(result.dtype), inner.to(result.dtype) if save_inner else None


def compose_bwd_eager(dy, inner, g, gm1, has_lx_base):
    """Eager twin of ``kernels.compose.compose_bwd``: ``(g dy, (g - 1) dy or None, sum_tokens dy * inner)``."""
    d32 = dy.to(g.dtype)
    gdy = (d32 * g).to(dy.dtype)
    d_lx_base = (d32 * gm1).to(dy.dtype) if has_lx_base else None
    dg = None if inner is None else (d32 * inner.to(g.dtype)).reshape(-1, dy.shape[-1]).sum(0)
    return gdy, d_lx_base, dg


def _compute_dtype(device_type: str, lora_A: torch.Tensor) -> torch.dtype:
    """The LoRA matmul dtype PEFT gets: the autocast dtype under autocast, else the adapter's dtype."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return lora_A.dtype


class ComposeFunction(torch.autograd.Function):
    """``result`` (+ ``lx_base``) and the LoRA path of ``lx`` -> DoRA output. See ``compose``."""

    @staticmethod
    def forward(ctx, result, lx, lx_base, bias, lora_A, lora_B, magnitude, norm, scaling):
        device_type = result.device.type
        cd = _compute_dtype(device_type, lora_A)
        triton = backend.use_triton(result)
        backend.count("triton" if triton else "eager")
        with torch.autocast(device_type, enabled=False):
            lx_c = lx.to(cd)
            a = F.linear(lx_c, lora_A.to(cd))  # [..., r]
            lora = F.linear(a, lora_B.to(cd))  # [..., d_out]
            g, gm1, inv = scales(magnitude, norm)
            if triton:
                from flashdora.kernels.compose import compose_fwd
            else:
                compose_fwd = compose_fwd_eager
            y, inner = compose_fwd(result, lora, g, gm1, scaling, bias, lx_base, save_inner=ctx.needs_input_grad[6])
        ctx.save_for_backward(lx_c, a, inner, lora_A, lora_B, g, gm1, inv)
        ctx.meta = (cd, scaling, lx_base is not None, bias is not None, lx.dtype, triton)
        return y

    @staticmethod
    def backward(ctx, dy):
        lx_c, a, inner, lora_A, lora_B, g, gm1, inv = ctx.saved_tensors
        cd, scaling, has_lx_base, has_bias, lx_dtype, triton = ctx.meta
        needs = ctx.needs_input_grad
        if triton:
            from flashdora.kernels.compose import compose_bwd
        else:
            compose_bwd = compose_bwd_eager
        with torch.autocast(dy.device.type, enabled=False):
            gdy, d_lx_base, dg = compose_bwd(dy.contiguous(), inner, g, gm1, has_lx_base)
            d_result = dy if has_lx_base else gdy
            d_bias = None
            if has_bias and not has_lx_base and needs[3]:
                d_bias = -(gm1 * dy.reshape(-1, dy.shape[-1]).to(g.dtype).sum(0))
            d_lx = d_A = d_B = None
            if needs[1] or needs[4] or needs[5]:
                gdy_c = gdy.to(cd).reshape(-1, gdy.shape[-1])  # [T, d_out]
                da = (gdy_c @ lora_B.to(cd)).mul_(scaling)  # [T, r]
                if needs[5]:
                    d_B = (gdy_c.T @ a.reshape(-1, a.shape[-1])).mul_(scaling)
                if needs[4]:
                    d_A = da.T @ lx_c.reshape(-1, lx_c.shape[-1])
                if needs[1]:
                    d_lx = (da @ lora_A.to(cd)).reshape(lx_c.shape).to(lx_dtype)
            d_m = None if dg is None else dg * inv
        return (
            d_result if needs[0] else None,
            d_lx,
            d_lx_base if needs[2] else None,
            d_bias,
            None if d_A is None else d_A.to(lora_A.dtype),
            None if d_B is None else d_B.to(lora_B.dtype),
            d_m,
            None,
            None,
        )


def compose(result, lx, lora_A, lora_B, magnitude, norm, scaling, *, bias=None, lx_base=None) -> torch.Tensor:
    """The DoRA output from the base layer's ``result = x W^T + bias`` (validated inputs; PEFT's variant calls this).

    ``lx_base is None``: ``y = g (result - bias + s lx A^T B^T) + bias`` (here ``lx`` is ``x``). Otherwise
    ``lx`` is the dropout-applied input and ``lx_base = lx W^T``: ``y = result + (g - 1) lx_base + g s lx A^T B^T``.
    ``g = magnitude / norm`` with ``norm`` treated as a constant. Output dtype: ``result.dtype``.
    """
    return ComposeFunction.apply(result, lx, lx_base, bias, lora_A, lora_B, magnitude, norm.detach(), scaling)


def dora_linear(x, weight, bias, lora_A, lora_B, magnitude, scaling, *, lora_x=None) -> torch.Tensor:
    """Output of a DoRA linear layer, exactly PEFT's function, for any leading batch dims.

    With ``g = magnitude / ||W + s B A||`` (row norm from ``factored_norm``, detached as in DoRA sec. 4.3):

    - ``lora_x is None`` (no dropout, or eval): ``y = g * (x W^T + s (x A^T) B^T) + bias``
    - ``lora_x`` given (the dropout-applied input): ``y = x W^T + bias + (g - 1) (lora_x W^T) + g s (lora_x A^T) B^T``

    Dtypes: ``g`` and the compose are computed in float32 (``g - 1`` as ``(m - norm) / norm``, never in 16 bits).
    Matmuls run in the autocast dtype under ``torch.autocast``, else the base matmul in ``weight``'s dtype and the
    LoRA matmuls in ``lora_A``'s dtype, as PEFT does. The output has the base matmul's dtype (``x.dtype``, or the
    autocast dtype). A row with zero norm outputs its bias and gets zero gradients.

    Args:
        x: ``[..., d_in]`` input.
        weight: ``[d_out, d_in]`` frozen base weight.
        bias: ``[d_out]`` or None.
        lora_A: ``[r, d_in]``; lora_B: ``[d_out, r]``.
        magnitude: ``[d_out]`` DoRA magnitude vector ``m``.
        scaling: finite real ``s`` (PEFT's ``lora_alpha / r``).
        lora_x: optional ``[..., d_in]`` dropout-applied input, same shape as ``x``.

    Returns:
        ``[..., d_out]`` tensor; differentiable in ``x``, ``lora_x``, ``weight``, ``bias``, ``lora_A``, ``lora_B``
        and ``magnitude``.

    Raises:
        TypeError: non-tensor or non-floating arguments; ``x`` and ``weight`` dtypes differ outside autocast.
        ValueError: mismatched shapes or devices, non-finite ``scaling``.
    """
    fn = "dora_linear"
    d_out, d_in, _ = _checks.lora_pair(fn, weight, lora_A, lora_B)
    _checks.tensor(fn, "x", x)
    if x.dim() < 1 or x.shape[-1] != d_in:
        raise ValueError(f"{fn}: x expected shape [..., {d_in}] (d_in from weight), got {list(x.shape)}")
    _checks.same_device(fn, "weight", weight, x, "x")
    if not torch.is_autocast_enabled(x.device.type) and x.dtype != weight.dtype:
        raise TypeError(f"{fn}: x expected dtype {weight.dtype} (the dtype of weight, outside autocast), got {x.dtype}")
    if bias is not None:
        _checks.tensor(fn, "bias", bias)
        _checks.shape(fn, "bias", bias, [d_out], "weight's d_out")
        _checks.same_device(fn, "bias", bias, x, "x")
    _checks.tensor(fn, "magnitude", magnitude)
    _checks.shape(fn, "magnitude", magnitude, [d_out], "weight's d_out")
    _checks.same_device(fn, "magnitude", magnitude, x, "x")
    if lora_x is not None:
        _checks.tensor(fn, "lora_x", lora_x)
        _checks.shape(fn, "lora_x", lora_x, list(x.shape), "x")
        _checks.same_device(fn, "lora_x", lora_x, x, "x")
    scaling = _checks.scaling(fn, scaling)

    norm = norm_from_parts(weight.detach(), lora_A.detach(), lora_B.detach(), scaling)
    result = F.linear(x, weight, bias)
    if lora_x is None:
        return compose(result, x, lora_A, lora_B, magnitude, norm, scaling, bias=bias)
    lx_base = F.linear(lora_x, weight)
    return compose(result, lora_x, lora_A, lora_B, magnitude, norm, scaling, lx_base=lx_base)
