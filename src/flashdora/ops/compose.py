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

from flashdora import backend, native
from flashdora.ops import compose_grad2 as _grad2


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


def _cast(t, dtype):
    """``t`` in ``dtype`` (``None``: as it is), without a torch call when it already is: a no-op ``.to()`` still
    costs one on the host path."""
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _compute_dtype(device_type: str, lora_A: torch.Tensor, autocast: bool) -> torch.dtype:
    """The LoRA matmul dtype PEFT gets: the autocast dtype under autocast, else the adapter's dtype."""
    return torch.get_autocast_dtype(device_type) if autocast else lora_A.dtype


# Elements of lora_B from which the fused forward gets it cast to the matmul dtype first (H100, T = 2048, r = 384:
# at d_out 27648 the in-register cast costs the kernel 18-28 us more than a cast pass plus the kernel on a 16-bit
# B; at d_out 4096 only 2-4 us, below the host time of one more launch).
_CAST_B_FIRST = 8 * 2**20


def _lora_a(lx, lora_A, compute_dtype, autocast: bool):
    """``a = lx A^T`` in the matmul dtype, as plain autograd ops: their backward (``dA``, ``d lx``, the casts back
    to the parameters' dtypes) runs in torch's C++ engine, as PEFT's does. Under autocast with grad, autocast casts
    both operands (in C++: no Python call for the cast). Without grad, ``lora_A`` is cast here, the same rounding in
    one op: autocast would keep its cast copy of a trainable leaf until its region ends, for every layer of a model's
    forward (1 GiB on llama3-8b at r = 384), where inference needs none of them."""
    if autocast and torch.float64 not in (lx.dtype, lora_A.dtype):
        return F.linear(lx, lora_A if torch.is_grad_enabled() else _cast(lora_A, compute_dtype))
    return F.linear(_cast(lx, compute_dtype), _cast(lora_A, compute_dtype))  # (autocast leaves float64 as it is)


_kc = None  # flashdora.kernels.compose, once a Triton call has imported it (``import flashdora`` needs no Triton)


def _import_kernels():
    """``flashdora.kernels.compose``, imported on the first Triton call and kept in ``_kc``: an import statement in
    the layer path costs more host time than the rest of a wrapper's argument handling."""
    global _kc
    from flashdora.kernels import compose as kc

    _kc = kc
    return kc


def _fwd(result, a, lx_base, bias, lora_B, scales, scaling, compute_dtype, save_inner, triton):
    """Forward body from the LoRA A output ``a``: ``(y, inner | None)``; ``triton``: ``backend.use_triton(result)``."""
    if triton:  # the LoRA B matmul runs inside the compose kernel, never written
        backend.count("triton")
        kc = _kc or _import_kernels()
        # A float32 lora_B is cast in the kernel's registers, except a large one: cast first, in one pass, where the
        # GPU time saved outweighs the extra launch's host time.
        b = lora_B if lora_B.numel() < _CAST_B_FIRST else _cast(lora_B, compute_dtype)
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

    ``d_result`` is ``g dy`` without ``lx_base``, ``dy`` with it. ``d_a`` and ``d_B`` are rounded to the matmul
    dtype (``a``'s), as the matmuls of PEFT's autocast path give them; autograd casts each gradient to its input's
    dtype (``lora_B``'s float32 on PEFT's adapters).
    """
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


DOUBLE_BACKWARD = _grad2.REFUSED  # (second order: ops/compose_grad2.py, after a forward under double_backward())


class ComposeFunction(torch.autograd.Function):
    """The eager autograd boundary (under ``torch.compile``, ``compose`` traces ``_compose_traced`` instead).

    Its inputs start at the LoRA A output ``a``: the A matmul stays outside, in plain autograd (``_lora_a``)."""

    @staticmethod
    def forward(ctx, result, a, lx_base, bias, lora_B, magnitude, scales, scaling, compute_dtype):
        save_inner = ctx.needs_input_grad[5]
        triton = backend.use_triton(result)
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
        if lora_B._version != b_version:
            raise RuntimeError(
                "flashdora: lora_B was modified by an inplace operation between the forward and the backward "
                f"(version {b_version} -> {lora_B._version}); the backward needs the values the forward used"
            )
        grads = _bwd(dy, a, inner, lora_B, scales, scaling, has_lx_base, has_bias, ctx.needs_input_grad, triton)
        return (*grads, None, None, None)


# ``Function.apply`` minus its Python wrapper (argument binding for ``setup_context`` and functorch's dead-wrapper
# unwrapping, 13 Python calls a layer call): the C++ entry it ends in, taken when no functorch transform is active.
_C_APPLY = getattr(torch._C, "_FunctionBase", None)
_APPLY = (
    _C_APPLY.__dict__["apply"].__get__(None, ComposeFunction)
    if _C_APPLY is not None and "apply" in _C_APPLY.__dict__ and backend.tested_versions()
    else ComposeFunction.apply
)  # (private: the public ``ComposeFunction.apply`` on torch versions the tests do not cover)


def _compose_traced(result, lx, lora_A, lora_B, magnitude, scales, scaling, compute_dtype, bias, lx_base):
    """The compose as plain torch ops, for ``torch.compile``: inductor fuses them (the compose into one pointwise
    kernel, the magnitude gradient into a reduction) and launches no Python between them.

    ``g`` and ``g - 1`` are constants, as on the eager path; the magnitude's gradient, ``sum dy * inner / norm``,
    comes from a term that is zero in value: ``(m - m.detach()) / norm * inner``. Backward then keeps only ``inner``
    in ``result``'s dtype, as the eager path does (with ``g`` differentiable it would keep both ``result`` and the
    LoRA output, and round the gradient differently).
    """
    g, gm1, inv = scales.unbind(0)
    need_m = magnitude.requires_grad and torch.is_grad_enabled()
    lora = F.linear(F.linear(lx.to(compute_dtype), lora_A.to(compute_dtype)), lora_B.to(compute_dtype))
    y, inner = compose_fwd_eager(result, lora, g, gm1, scaling, bias, lx_base, save_inner=need_m)
    if not need_m:
        return y
    m = magnitude.to(inv.dtype)
    inner = inner if _grad2._ON else inner.detach()  # (double_backward: d/d inner gets the zero term's m edge)
    return y + ((m - m.detach()) * inv * inner.to(inv.dtype)).to(y.dtype)  # + 0, d/dm = inner / norm


def compose(result, lx, lora_A, lora_B, magnitude, scales, scaling, *, bias=None, lx_base=None, seq=-1) -> Tensor:
    """The DoRA output from the base layer's ``result = x W^T + bias`` (validated inputs; PEFT's variant calls this).

    ``lx_base is None``: ``y = g (result - bias + s lx A^T B^T) + bias`` (here ``lx`` is ``x``). Otherwise
    ``lx`` is the dropout-applied input and ``lx_base = lx W^T``: ``y = result + (g - 1) lx_base + g s lx A^T B^T``.
    ``scales`` is ``dora_scales(...)``: ``(g, g - 1, 1 / norm)`` for ``magnitude``. Output dtype: ``result.dtype``.
    Eager calls run the LoRA A matmul in plain autograd, then ``ComposeFunction`` (the fused kernels on the Triton
    path); compiled graphs plain torch ops. ``seq``: see ``after_base`` (eager calls only).
    """
    if torch.compiler.is_compiling():
        device_type = result.device.type
        cd = _compute_dtype(device_type, lora_A, torch.is_autocast_enabled(device_type))
        return _compose_traced(result, lx, lora_A, lora_B, magnitude, scales, scaling, cd, bias, lx_base)
    return compose_eager(result, lx, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base, seq)


def compose_eager(result, lx, lora_A, lora_B, magnitude, scales, scaling, bias=None, lx_base=None, seq=-1) -> Tensor:
    """``compose`` outside ``torch.compile`` (callers that know they are eager skip the check).

    On the Triton path a call runs in ``flashdora.native``'s C++ forward once that holds the launch plans of its
    kernels (dropout's ``lx_base`` with no bias, as PEFT calls it); the call that finds none runs the Python path
    below and files them. ``seq``: see ``after_base``."""
    if _grad2._ON:  # forwards a second backward can go through (flashdora.double_backward)
        return _grad2.compose_eager(result, lx, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base, seq)
    unplanned = False
    if (lx_base is None or bias is None) and result.is_cuda and native.enabled() and backend.use_triton(result):
        mod = _native if _native is not None else _load_native()
        if mod is not False and not (torch.is_grad_enabled() and backend.functorch_active()):
            y = mod.forward(result, lx, lora_A, lora_B, magnitude, scales, bias, float(scaling), seq, lx_base)
            if y is not None and y is not False:
                backend.count("triton")
                if torch.is_grad_enabled():
                    backend.count("native")
                return y
            unplanned = y is False
    y = _compose_python(result, lx, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base, seq)
    if unplanned:
        _file_plans(result, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base)
    return y


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


def _compose_python(result, lx, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base, seq=-1) -> Tensor:
    device_type = result.device.type
    autocast = torch.is_autocast_enabled(device_type)
    cd = _compute_dtype(device_type, lora_A, autocast)
    a = _lora_a(lx, lora_A, cd, autocast)  # [..., r]
    if not torch.is_grad_enabled():  # inference: no autograd boundary to cross, nothing to save
        return _fwd(result, a, lx_base, bias, lora_B, scales, scaling, cd, False, backend.use_triton(result))[0]
    if backend.functorch_active():
        return ComposeFunction.apply(result, a, lx_base, bias, lora_B, magnitude, scales, scaling, cd)
    if seq >= 0 and a.grad_fn is not None:
        a.grad_fn._set_sequence_nr(seq)
    if result.is_cuda and magnitude.requires_grad:
        y = _compose_native(result, a, bias, lora_B, scales, scaling, magnitude, cd, lx_base)
        if y is not None:
            return y
    return _APPLY(result, a, lx_base, bias, lora_B, magnitude, scales, scaling, cd)


_native = None  # flashdora.native's extension once loaded (on the first call switched on); False: its build failed


def _load_native():
    """The extension, or ``False`` for this call: still building in the background, built but not adopted yet (a
    call without grad adopts it: ``native.module``), or its build failed (kept: never asked again)."""
    global _native
    mod = native.module(wait=False)
    if mod is None:
        native.adopt_without_grad()
        mod = native.module(wait=False)
    if mod is not None:
        _native = mod
    elif native.failed():
        _native = False
    return mod or False


def _file_plans(result, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base=None) -> None:
    """Give ``flashdora.native``'s forward the launch plan of the forward kernel a call like this one runs (in
    training, saving ``inner``), once the Python path has compiled it (a shape's first calls tune, then compile). The
    backward kernel's plan is filed by ``_compose_native``, the first forward after that kernel compiled."""
    kc = _kc or _import_kernels()
    train = torch.is_grad_enabled() and magnitude.requires_grad
    device_type = result.device.type
    cd = _compute_dtype(device_type, lora_A, torch.is_autocast_enabled(device_type))
    n = result.shape[-1]
    # a stand-in for the LoRA A output: the plan depends on its dtype, width and alignment only
    a = result.new_empty((result.numel() // n, lora_A.shape[0]), dtype=cd)
    with torch.no_grad():
        b = lora_B if lora_B.numel() < _CAST_B_FIRST else _cast(lora_B, cd)
    plan = kc.fwd_plan(result, a, b, scales, scaling, bias, train, lx_base)
    if plan is not None:
        _native.register_forward(result, a, b, scales, bias, train, *plan, lx_base=lx_base)


def _compose_native(result, a, bias, lora_B, scales, scaling, magnitude, cd, lx_base=None):
    """``ComposeFunction``'s Triton path with its backward as ``flashdora.native``'s C++ node, or ``None`` where that
    does not apply: switched off, no Triton, no built extension, a trainable bias (or any bias with dropout's
    ``lx_base``, which PEFT's exact form never passes), or a backward kernel not compiled yet (the Python path's
    first backward compiles it). The first call switched on starts the node's build in the background (``None``
    until it is ready: the Python path runs meanwhile)."""
    if not native.enabled() or not backend.use_triton(result):
        return None
    if bias is not None and (bias.requires_grad or lx_base is not None):
        return None
    if (_native if _native is not None else _load_native()) is False:
        return None
    kc = _kc or _import_kernels()
    n = result.shape[-1]
    has_lx = lx_base is not None
    plan = kc.bwd_plan(result.numel() // n if n else 0, n, result.dtype, scales, has_lx)
    if plan is None:
        return None
    _native.register_backward(result, scales, *plan, has_lx_base=has_lx)  # (the C++ forward takes the next call)
    backend.count("triton")
    backend.count("native")
    b = lora_B if lora_B.numel() < _CAST_B_FIRST else _cast(lora_B, cd)
    y, inner = kc.compose_fwd_fused(result, a, b, scales, scaling, bias, lx_base, save_inner=True)
    _native.attach(y, result, a, lora_B, magnitude, inner, scales, float(scaling), *plan, lx_base=lx_base)
    return y
