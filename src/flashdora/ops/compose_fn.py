"""The DoRA compose's math and its autograd boundary: the eager forward and backward twins of the Triton kernels,
the LoRA A matmul, and ``ComposeFunction`` (first order; ``ops/compose_grad2.py`` has the second). Which of them a
call runs is the route's (``dispatch``, ``ops/compose.py``). Math: docs/math.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashdora import backend, config
from flashdora._dtypes import cast, compute_dtype


def compose_fwd_eager(result, lora, g, gm1, scaling, bias=None, lx_base=None, save_inner=True):
    """Eager twin of ``kernels.compose.compose_fwd``: ``(y, inner)`` in ``result.dtype``, fp32 math.

    PEFT's form and rounding: ``y = result + (g - 1) base + g s lora`` with ``base = lx_base``, else
    ``result - bias`` in the dtype torch promotes them to (bf16 for a bf16 layer under autocast), else ``result``.
    """
    acc = g.dtype
    if lx_base is not None:
        base = lx_base.to(acc)
    elif bias is not None:
        base = (result - bias).to(acc)
    else:
        base = result.to(acc)
    s_lora = lora.to(acc) * scaling
    y = result.to(acc) + gm1 * base + g * s_lora
    return y.to(result.dtype), s_lora.add_(base).to(result.dtype) if save_inner else None


def compose_bwd_eager(dy, inner, scales, has_lx_base, gdy_scale=1.0):
    """Eager twin of ``kernels.compose.compose_bwd``: ``((dy gdy_scale) g, (g - 1) dy or None,
    sum_tokens dy * inner / norm)``."""
    g, gm1, inv = scales
    d32 = dy.to(g.dtype)
    gdy = ((d32 * gdy_scale if gdy_scale != 1.0 else d32) * g).to(dy.dtype)
    d_lx_base = (d32 * gm1).to(dy.dtype) if has_lx_base else None
    dg = None if inner is None else (d32 * inner.to(g.dtype)).reshape(-1, dy.shape[-1]).sum(0) * inv
    return gdy, d_lx_base, dg


_cast, _compute_dtype = cast, compute_dtype  # (the names the rest of ops/ and the tests use)


def _lora_a(lx, lora_A, compute_dtype, autocast: bool):
    """``a = lx A^T`` in the matmul dtype, as plain autograd ops (their backward runs in torch's C++ engine, as
    PEFT's does). Under autocast with grad, autocast casts both operands; without grad, ``lora_A`` is cast here:
    autocast would keep every layer's cast copy until its region ends (docs/host-notes.md)."""
    if autocast and torch.float64 not in (lx.dtype, lora_A.dtype):
        return F.linear(lx, lora_A if torch.is_grad_enabled() else _cast(lora_A, compute_dtype))
    return F.linear(_cast(lx, compute_dtype), _cast(lora_A, compute_dtype))  # (autocast leaves float64 as it is)


def lora_a_for(result, lx, lora_A, seq=-1):
    """``(a, compute dtype)`` for a compose producing ``result``: ``_lora_a`` in the dtype PEFT's matmul gets, its
    autograd node given the sequence number ``seq`` (``ops.compose.after_base``; ``-1``: as recorded)."""
    device_type = result.device.type
    autocast = torch.is_autocast_enabled(device_type)
    cd = _compute_dtype(device_type, lora_A, autocast)
    a = _lora_a(lx, lora_A, cd, autocast)  # [..., r]
    if seq >= 0 and a.grad_fn is not None:
        a.grad_fn._set_sequence_nr(seq)
    return a, cd


def check_version(lora_B, b_version) -> None:
    """Refuse a backward whose ``lora_B`` was written in place after the forward (its values are gone)."""
    if lora_B._version != b_version:
        raise RuntimeError(
            "flashdora: lora_B was modified by an inplace operation between the forward and the backward "
            f"(version {b_version} -> {lora_B._version}); the backward needs the values the forward used"
        )


_kc = None  # flashdora.kernels.compose, once a Triton call has imported it (``import flashdora`` needs no Triton)


def _import_kernels():
    """``flashdora.kernels.compose``, imported on the first Triton call and kept in ``_kc``: an import statement in
    the layer path costs more host time than the rest of a wrapper's argument handling."""
    global _kc
    from flashdora.kernels import compose as kc

    _kc = kc
    return kc


def _fwd(result, a, lx_base, bias, lora_B, scales, scaling, compute_dtype, save_inner, triton):
    """Forward body from the LoRA A output ``a``: ``(y, inner | None)``; ``triton``: the route's (``dispatch``)."""
    if triton:  # the LoRA B matmul runs inside the compose kernel, never written
        backend.count("triton")
        kc = _kc or _import_kernels()
        # A float32 lora_B is cast in the kernel's registers, except a large one or one many tokens re-read: cast
        # first, in one pass, where the GPU time saved outweighs the extra launch's host time.
        t = a.numel() // a.shape[-1] if a.shape[-1] else 0
        b = _cast(lora_B, compute_dtype) if kc.cast_b_first(lora_B, t) else lora_B
        return kc.compose_fwd_fused(result, a, b, scales, scaling, bias, lx_base, save_inner=save_inner)
    backend.count("eager")
    g, gm1, _ = scales.unbind(0)
    lora = F.linear(a, _cast(lora_B, compute_dtype))  # [..., d_out]
    return compose_fwd_eager(result, lora, g, gm1, scaling, bias, lx_base, save_inner=save_inner)


_ZEROS: dict[tuple, torch.Tensor] = {}


def _mm(x, y, alpha):
    """``alpha x @ y`` in the operands' dtype: a LoRA weight's gradient, rounded where PEFT's autocast matmul rounds
    it (autograd then casts it to the parameter's dtype). ``s`` rides on the GEMM's alpha, never on a separate pass
    (``addmm`` with ``beta = 0`` ignores its input: one cached 0-dim tensor per dtype and device)."""
    if alpha == 1.0:
        return torch.mm(x, y)
    key = (x.dtype, x.device)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = _ZEROS[key] = x.new_zeros(())
    return torch.addmm(zero, x, y, beta=0, alpha=alpha)


def _bwd(dy, a, inner, lora_B, scales, scaling, has_lx_base, has_bias, needs, triton):
    """Backward body: ``[d_result, d_a, d_lx_base, d_bias, d_B, d_m]``, None where not needed (``needs``, that order).
    ``d_result`` is ``g dy`` without ``lx_base``, ``dy`` with it; ``d_a`` and ``d_B`` are rounded to the matmul dtype
    (``a``'s), as PEFT's autocast matmuls give them, and autograd casts each to its input's dtype."""
    if torch.is_autocast_enabled(dy.device.type):  # (on CUDA the backward runs with autocast off already)
        with torch.autocast(dy.device.type, enabled=False):
            return _bwd(dy, a, inner, lora_B, scales, scaling, has_lx_base, has_bias, needs, triton)
    cd = a.dtype
    out = [None] * 6
    # PEFT rounds the LoRA branch's gradient as (dy s) g. With lx_base, g dy feeds only the LoRA GEMMs: round it
    # that way and run them with alpha 1. Without, it is also d_result: keep g dy, put s on the GEMMs' alpha
    # (the same bits when s is a power of two; one rounding apart otherwise).
    lora_scale, alpha = (scaling, 1.0) if has_lx_base else (1.0, scaling)
    if triton:  # the forward's choice (same device)
        gdy, d_lx_base, dg = (_kc or _import_kernels()).compose_bwd(dy, inner, scales, has_lx_base, lora_scale)
    else:
        gdy, d_lx_base, dg = compose_bwd_eager(dy, inner, scales, has_lx_base, lora_scale)
    if needs[0]:
        out[0] = dy if has_lx_base else gdy
    if needs[2] and has_lx_base:
        out[2] = d_lx_base
    if needs[3] and has_bias and not has_lx_base:
        out[3] = -(scales[1] * dy.reshape(-1, dy.shape[-1]).to(scales.dtype).sum(0))
    if needs[1] or needs[4]:
        n, r = gdy.shape[-1], a.shape[-1]
        gdy_c = _cast(gdy.reshape(-1, n) if gdy.dim() != 2 else gdy, cd)  # [T, d_out] (eager: dy's strides)
        if needs[4]:
            out[4] = _mm(gdy_c.T, a.view(-1, r) if a.dim() != 2 else a, alpha)  # s gdy^T a: [d_out, r]
        if needs[1]:
            da = _mm(gdy_c, _cast(lora_B, cd), alpha)  # s gdy B: [T, r]
            out[1] = da.view(a.shape) if a.dim() != 2 else da
    if needs[5]:
        out[5] = dg
    return out


DOUBLE_BACKWARD = (
    "flashdora: a gradient of a gradient (create_graph=True) through a DoRA layer needs the layer's forward to have "
    "run with flashdora.double_backward() on (e.g. `with flashdora.double_backward(): loss = model(x)`; first-order "
    "training never pays for it), or the model on PEFT's DoRA (flashdora.disable(model))"
)


class ComposeFunction(torch.autograd.Function):
    """The eager autograd boundary (under ``torch.compile``, ``compose`` traces ``_compose_traced`` instead).

    Its inputs start at the LoRA A output ``a``: the A matmul stays outside, in plain autograd (``_lora_a``)."""

    @staticmethod
    def forward(ctx, result, a, lx_base, bias, lora_B, magnitude, scales, scaling, compute_dtype, triton):
        save_inner = ctx.needs_input_grad[5]
        y, inner = _fwd(result, a, lx_base, bias, lora_B, scales, scaling, compute_dtype, save_inner, triton)
        ctx.save_for_backward(a, inner)
        # lora_B (a parameter, alive anyway) and the [3, d_out] scales ride on ctx instead: under gradient
        # checkpointing every saved tensor costs Python pack and unpack hooks. lora_B's version is checked by hand.
        ctx.meta = (scaling, lx_base is not None, bias is not None, lora_B, lora_B._version, scales, triton)
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # create_graph=True: inner has no edges here (ComposeGrad2 keeps them)
            raise RuntimeError(DOUBLE_BACKWARD)
        a, inner = ctx.saved_tensors
        scaling, has_lx_base, has_bias, lora_B, b_version, scales, triton = ctx.meta
        check_version(lora_B, b_version)
        grads = _bwd(dy, a, inner, lora_B, scales, scaling, has_lx_base, has_bias, ctx.needs_input_grad, triton)
        return (*grads, None, None, None, None)


# ``Function.apply`` minus its Python wrapper (argument binding for ``setup_context`` and functorch's dead-wrapper
# unwrapping, 13 Python calls a layer call): the C++ entry it ends in, taken when no functorch transform is active.
_C_APPLY = getattr(torch._C, "_FunctionBase", None)
_C_APPLY_BOUND = (
    _C_APPLY.__dict__["apply"].__get__(None, ComposeFunction)
    if _C_APPLY is not None and "apply" in _C_APPLY.__dict__
    else None
)  # (private: the public ``ComposeFunction.apply`` where ``config.private`` is off: untested torch, or switched off)


def _apply(*args):
    return _C_APPLY_BOUND(*args) if config.private and _C_APPLY_BOUND is not None else ComposeFunction.apply(*args)
