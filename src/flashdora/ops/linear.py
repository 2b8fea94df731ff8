"""``dora_linear``: the public DoRA linear function (validated inputs, the norm from the cache, then the compose).

The compose itself is ``ops/compose.py`` (a route's execution, the traced form for ``torch.compile``) over
``ops/compose_fn.py`` (the eager twins, the autograd boundary); the norm and its cache are ``ops/norm.py`` and
``ops/norm_cache.py``. Math: docs/math.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashdora import _checks, backend, dispatch
from flashdora._dtypes import autocast_on
from flashdora.ops.compose import run_compose
from flashdora.ops.norm_cache import NormCache, dora_scales


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
    autocast = autocast_on(x.device.type)
    if not autocast and x.dtype != weight.dtype:  # (autocast casts them alike)
        raise TypeError(
            f"{fn}: x expected dtype {weight.dtype} (the dtype of weight, outside autocast), got {x.dtype}"
        )
    if bias is not None:
        _checks.tensor(fn, "bias", bias)
        _checks.shape(fn, "bias", bias, [d_out], "weight's d_out")
        _checks.same_device(fn, "bias", bias, x, "x")
        if not autocast and bias.dtype != weight.dtype:
            raise TypeError(
                f"{fn}: bias expected dtype {weight.dtype} (the dtype of weight, outside autocast), got {bias.dtype}"
            )
    _checks.tensor(fn, "magnitude", magnitude)
    _checks.shape(fn, "magnitude", magnitude, [d_out], "weight's d_out")
    _checks.same_device(fn, "magnitude", magnitude, x, "x")
    if lora_x is not None:
        _checks.tensor(fn, "lora_x", lora_x)
        _checks.shape(fn, "lora_x", lora_x, list(x.shape), "x")
        _checks.same_device(fn, "lora_x", lora_x, x, "x")
        if not autocast and lora_x.dtype != x.dtype:
            raise TypeError(
                f"{fn}: lora_x expected dtype {x.dtype} (the dtype of x, outside autocast), got {lora_x.dtype}"
            )
    scaling = _checks.scaling(fn, scaling)
    route = dispatch.linear_reference_route(x, weight)
    if route is not None:  # shapes only, or a torch.func transform: the plain-torch formula, which composes with both
        if route.compose == "peft":
            backend.count("fallback:torch.func")
            backend.warn_once("torch.func", "flashdora: dora_linear under a torch.func transform runs plain torch ops")
        from flashdora.reference import dora_linear_ref

        return dora_linear_ref(x, weight, bias, lora_A, lora_B, magnitude, scaling, lora_x)
    result = F.linear(x, weight, bias)
    route = dispatch.linear_route(x, weight, bias, lora_A, lora_B, magnitude, result, lora_x is not None)
    if route.compose == "traced":
        scales = dora_scales(weight, lora_A, lora_B, magnitude, scaling)
    else:
        scales = NormCache.lookup(weight, lora_A, lora_B, magnitude, scaling, -1, impl=route.norm)
    if lora_x is None:
        return run_compose(route.compose, result, x, lora_A, lora_B, magnitude, scales, scaling, bias=bias)
    lx_base = F.linear(lora_x, weight)
    return run_compose(route.compose, result, lora_x, lora_A, lora_B, magnitude, scales, scaling, lx_base=lx_base)
