"""Second-order gradients through the DoRA compose (``create_graph=True``: gradient penalties, meta-learning).

PEFT's DoRA is plain torch ops with ``g = m / ||W + s B A||.detach()``, so a gradient of its gradient differentiates
every first-order gradient again: in ``g`` (the magnitude), in ``dy``, ``a`` and ``lora_B``, and, through the
magnitude's gradient ``sum dy * inner / norm``, in ``inner`` and so in the base output's producers (``x``, a
trainable base weight or bias). ``ComposeFunction`` saves ``inner`` as a value without those edges, and the only
handle on them a custom function can keep is one more autograd output, which costs host time on every forward
(docs/design.md, "Decisions": double backward). So second order is an opt-in, and first-order training pays nothing:

- ``double_backward()`` on (a call, or a ``with`` block around the forward; the setting ``config.double_backward``):
  the compose runs ``ComposeGrad2``, the same forward (kernels, saved tensors) that also returns ``inner`` as an
  output. Its backward under grad mode builds the first-order gradients from differentiable torch ops
  (``g = scales[0] + (m - m.detach()) / norm``: exact value, edge to ``m``); a gradient that reaches ``inner`` in the
  second backward comes back to this node, which sends it on as ``inner``'s own derivatives (``result``, ``bias``,
  ``lx_base``, ``a``, ``lora_B``). Exact to any order.
- off (the default): ``ComposeFunction``'s backward and the C++ node refuse ``create_graph=True`` with ``REFUSED``.
"""

from __future__ import annotations

import torch

from flashdora import backend, config
from flashdora.ops.compose_fn import DOUBLE_BACKWARD as REFUSED  # noqa: F401 - the refusal's text, named here too
from flashdora.ops.compose_fn import _bwd, _fwd, _mm, check_version, lora_a_for


class double_backward:  # noqa: N801 - used like torch.set_grad_enabled: a call, or a context manager
    """Let gradients of gradients (``create_graph=True``) through flashdora's DoRA layers: PEFT's second order.

    ``flashdora.double_backward()`` switches it on for the process, ``double_backward(False)`` off again; as a
    context manager (``with flashdora.double_backward(): loss = model(x)``) it holds for the block, then restores the
    previous setting. It is the setting ``double_backward`` (``flashdora.configure(double_backward=True)`` does the
    same). What counts is the setting during the forward: a forward run with it on can be differentiated twice; one
    run with it off refuses ``create_graph=True`` in its backward. It costs such forwards one more autograd output a
    layer (host time, no memory) and their create-graph backwards plain torch ops instead of the fused kernels;
    forwards without it pay nothing. Such forwards take the ``double-eager`` or ``double-triton`` route, never the
    C++ compose (docs/design.md, "Routes").
    """

    def __init__(self, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"double_backward: enabled expected a bool, got {type(enabled).__name__}")
        self.prev = config.configure(double_backward=enabled)["double_backward"]

    def __enter__(self) -> double_backward:
        return self

    def __exit__(self, *exc) -> None:
        config.configure(double_backward=self.prev)


def enabled() -> bool:
    """Whether forwards run now support a second backward (``double_backward``)."""
    return config.double_backward


def compose(triton, result, lx, lora_A, lora_B, magnitude, scales, scaling, bias=None, lx_base=None, seq=-1):
    """The compose on the ``double-eager`` / ``double-triton`` route (a forward with grad under ``double_backward``):
    ``ComposeGrad2``, with the Triton kernels where ``triton``."""
    a, cd = lora_a_for(result, lx, lora_A, seq)
    return ComposeGrad2.apply(result, a, lx_base, bias, lora_B, magnitude, scales, scaling, cd, triton)[0]


class ComposeGrad2(torch.autograd.Function):
    """``ComposeFunction`` with ``inner`` as a second output (the handle on its producers a second backward needs)."""

    @staticmethod
    def forward(ctx, result, a, lx_base, bias, lora_B, magnitude, scales, scaling, compute_dtype, triton):
        save_inner = ctx.needs_input_grad[5]
        y, inner = _fwd(result, a, lx_base, bias, lora_B, scales, scaling, compute_dtype, save_inner, triton)
        ctx.save_for_backward(a, inner)  # (inner: an output, saved as one)
        ctx.meta = (scaling, lx_base is not None, bias is not None, lora_B, lora_B._version, scales, triton)
        ctx.magnitude = magnitude
        ctx.set_materialize_grads(False)
        return y, inner

    @staticmethod
    def backward(ctx, dy, d_inner):
        a, inner = ctx.saved_tensors
        scaling, has_lx, has_bias, lora_B, b_version, scales, triton = ctx.meta
        check_version(lora_B, b_version)
        needs = ctx.needs_input_grad
        with backend.autocast_off(a.device.type):
            if dy is None:
                grads = [None] * 6
            elif torch.is_grad_enabled():
                grads = graph_grads(dy, a, inner, lora_B, ctx.magnitude, scales, scaling, has_lx, has_bias, needs)
            else:
                grads = _bwd(dy, a, inner, lora_B, scales, scaling, has_lx, has_bias, needs, triton)
            if d_inner is not None:
                add_inner_grads(grads, d_inner, a, lora_B, scaling, has_lx, has_bias, needs)
        return (*grads, None, None, None, None)


def graph_grads(dy, a, inner, lora_B, magnitude, scales, scaling, has_lx, has_bias, needs):
    """``ops.compose_fn._bwd``'s gradients as differentiable torch ops (same order, same roundings as its eager path).

    ``g`` and ``g - 1`` carry the zero-valued ``(m - m.detach()) / norm``: their value is the scales', their
    derivative in ``m`` is ``1 / norm``, as PEFT's ``m / norm.detach()`` has it. ``inner`` is the forward's output
    (its gradient comes back to ``ComposeGrad2``)."""
    out = [None] * 6
    g, gm1, inv = scales.unbind(0)
    acc = scales.dtype
    z = (magnitude.to(acc) - magnitude.detach().to(acc)) * inv
    g, gm1 = g + z, gm1 + z
    n = dy.shape[-1]
    d32 = dy.to(acc)
    gdy = ((d32 * scaling if has_lx else d32) * g).to(dy.dtype)
    if needs[0]:
        out[0] = dy if has_lx else gdy
    if needs[2] and has_lx:
        out[2] = (d32 * gm1).to(dy.dtype)
    if needs[3] and has_bias and not has_lx:
        out[3] = -(gm1 * d32.reshape(-1, n).sum(0))
    alpha = 1.0 if has_lx else scaling
    gdy_c = gdy.reshape(-1, n).to(a.dtype)
    if needs[4]:
        out[4] = _mm(gdy_c.T, a.reshape(-1, a.shape[-1]), alpha)  # s gdy^T a
    if needs[1]:
        out[1] = _mm(gdy_c, lora_B.to(a.dtype), alpha).view(a.shape)  # s gdy B
    if needs[5] and inner is not None:
        out[5] = (d32 * inner.to(acc)).reshape(-1, n).sum(0) * inv
    return out


def add_inner_grads(grads, c, a, lora_B, scaling, has_lx, has_bias, needs) -> None:
    """Add to ``grads`` the derivatives of ``inner`` against ``c``: ``inner = base + s a B^T`` with ``base =
    lx_base``, else ``result - bias``."""
    if has_lx:
        if needs[2]:
            grads[2] = _plus(grads[2], c)
    else:
        if needs[0]:
            grads[0] = _plus(grads[0], c)
        if needs[3] and has_bias:
            grads[3] = _plus(grads[3], -c.reshape(-1, c.shape[-1]).sum(0))
    c2 = c.reshape(-1, c.shape[-1]).to(a.dtype)
    if needs[4]:
        grads[4] = _plus(grads[4], _mm(c2.T, a.reshape(-1, a.shape[-1]), scaling))
    if needs[1]:
        grads[1] = _plus(grads[1], _mm(c2, lora_B.to(a.dtype), scaling).view(a.shape))


def _plus(x, y):
    return y if x is None else x + y  # (autograd casts each gradient to its input's dtype)
