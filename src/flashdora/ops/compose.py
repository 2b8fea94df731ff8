"""The DoRA compose: autograd boundary, eager forward and backward (``dora_linear``, the public function, is in
``ops/linear.py``).

``compose`` takes the base layer's output (``result = x W^T + bias``, as PEFT hands it to its variants) and adds
the DoRA delta with the LoRA matmuls inside, so the Triton path can fuse the compose into them. Eager calls cross
one ``autograd.Function`` (fused kernels on the Triton path). Under ``torch.compile`` the compose is plain torch
ops that inductor fuses itself, with no break in the graph; only the norm lookup stays an opaque custom op
(``flashdora::dora_scales``), since the cache lives outside the graph. Math: docs/math.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flashdora import backend, config, dispatch
from flashdora.native import bridge
from flashdora.ops import compose_grad2
from flashdora.ops.compose_fn import (  # noqa: F401 - re-exported: callers and tests name them here
    DOUBLE_BACKWARD,
    ComposeFunction,
    _apply,
    _bwd,
    _cast,
    _compute_dtype,
    _fwd,
    _mm,
    compose_bwd_eager,
    compose_fwd_eager,
    lora_a_for,
)


def _compose_traced(result, lx, lora_A, lora_B, magnitude, scales, scaling, compute_dtype, bias, lx_base):
    """The compose as plain torch ops, for ``torch.compile`` (inductor fuses them). ``g`` and ``g - 1`` are constants,
    as on the eager path; the magnitude's gradient comes from ``(m - m.detach()) / norm * inner``, zero in value, so
    backward keeps only ``inner`` (docs/host-notes.md)."""
    g, gm1, inv = scales.unbind(0)
    need_m = magnitude.requires_grad and torch.is_grad_enabled()
    lora = F.linear(F.linear(lx.to(compute_dtype), lora_A.to(compute_dtype)), lora_B.to(compute_dtype))
    y, inner = compose_fwd_eager(result, lora, g, gm1, scaling, bias, lx_base, save_inner=need_m)
    if not need_m:
        return y
    m = magnitude.to(inv.dtype)
    inner = inner if config.double_backward else inner.detach()  # (double_backward: d/d inner gets m's zero term)
    return y + ((m - m.detach()) * inv * inner.to(inv.dtype)).to(y.dtype)  # + 0, d/dm = inner / norm


def compose(result, lx, lora_A, lora_B, magnitude, scales, scaling, *, bias=None, lx_base=None, seq=-1) -> Tensor:
    """The DoRA output from the base layer's ``result = x W^T + bias`` (validated inputs), routed here
    (``dispatch.compose_impl``); PEFT's variant routes once for the whole call and calls ``run_compose``.

    ``lx_base is None``: ``y = g (result - bias + s lx A^T B^T) + bias`` (here ``lx`` is ``x``). Otherwise
    ``lx`` is the dropout-applied input and ``lx_base = lx W^T``: ``y = result + (g - 1) lx_base + g s lx A^T B^T``.
    ``scales`` is ``dora_scales(...)``: ``(g, g - 1, 1 / norm)`` for ``magnitude``. Output dtype: ``result.dtype``.
    Eager calls run the LoRA A matmul in plain autograd, then ``ComposeFunction`` (the fused kernels on the Triton
    path); compiled graphs plain torch ops. ``seq``: see ``after_base`` (eager calls only).
    """
    impl = "traced" if torch.compiler.is_compiling() else dispatch.compose_impl(result, bias, lx_base is not None)
    args = (result, lx, lora_A, lora_B, magnitude, scales, scaling)
    return run_compose(impl, *args, bias=bias, lx_base=lx_base, seq=seq)


def run_compose(impl, result, lx, lora_A, lora_B, magnitude, scales, scaling, *, bias=None, lx_base=None, seq=-1):
    """``compose`` by the route's ``impl`` (``dispatch.COMPOSE``: ``traced``, ``eager``, ``triton`` or ``native``)."""
    if impl in ("double-eager", "double-triton"):  # forwards a second backward can go through (double_backward)
        return compose_grad2.compose(impl == "double-triton", result, lx, lora_A, lora_B, magnitude, scales, scaling,
                                     bias, lx_base, seq)  # fmt: skip
    if impl == "traced":
        device_type = result.device.type
        cd = _compute_dtype(device_type, lora_A, torch.is_autocast_enabled(device_type))
        return _compose_traced(result, lx, lora_A, lora_B, magnitude, scales, scaling, cd, bias, lx_base)
    return compose_eager(result, lx, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base, seq, impl)


def compose_eager(
    result, lx, lora_A, lora_B, magnitude, scales, scaling, bias=None, lx_base=None, seq=-1, impl=None
) -> Tensor:
    """``compose`` outside ``torch.compile``; ``impl``: ``eager``, ``triton`` or ``native`` (``None``: routed here).

    ``native``: the C++ forward and node (``native.bridge.compose``). ``seq``: see ``after_base``."""
    if impl is None:
        impl = dispatch.compose_impl(result, bias, lx_base is not None)
    args = (result, lx, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base, seq)
    if impl == "native":
        return bridge.compose(*args, python=_compose_python)
    return _compose_python(impl, *args)


def after_base() -> int:
    """The ``seq`` to give ``compose_eager`` when it is called right before the base layer runs (-1 without grad).

    The autograd engine runs ready nodes highest sequence number first. The base layer and the LoRA A matmul both
    wait on the compose's backward; the A matmul, recorded later, would run first and allocate its ``d x`` while
    ``g dy``, the base layer's gradient, still waits (one ``[tokens, d_out]`` block more at the step's peak). Its
    node gets a sequence number just below every node the base layer records, so the base runs first and frees
    ``g dy`` before. Only the order of ready nodes changes."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():  # (compiled graphs order their own backward)
        return -1
    if _sequence_nr is None or not backend.private_apis():  # the engine's order as recorded (more peak memory)
        return -1
    return max(_sequence_nr() - 1, 0)


_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)  # private: gated in after_base


def _compose_python(impl, result, lx, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base, seq=-1) -> Tensor:
    a, cd = lora_a_for(result, lx, lora_A, seq)  # (no grad: no node to order)
    triton = impl != "eager"
    if not torch.is_grad_enabled():  # inference: no autograd boundary to cross, nothing to save
        return _fwd(result, a, lx_base, bias, lora_B, scales, scaling, cd, False, triton)[0]
    return _apply(result, a, lx_base, bias, lora_B, magnitude, scales, scaling, cd, triton)
