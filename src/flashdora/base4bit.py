"""The base result of a bitsandbytes 4-bit layer, where bitsandbytes itself computes ``F.linear(x, dequantize(W))``.

bitsandbytes' ``Linear4bit.forward`` reaches its ``gemm_4bit`` op through several Python layers (the module's
checks, ``matmul_4bit``, an autograd Function, the op's dispatch, the nested absmax's dequantization); past
``_gemm_4bit_custom_max_m`` rows (1536 on CUDA in 0.50) that op dequantizes the weight and calls ``F.linear``, and its
backward dequantizes again for ``grad_x``. On a flashdora DoRA layer, ``result`` computes the same: the weight
dequantized by bitsandbytes' own kernels launched from C++ (``layers.dequantized``: the same bits), ``F.linear``
with the same operands, and a backward that dequantizes again; a few microseconds of the host's time where
bitsandbytes' path takes a few hundred a layer and step. Wherever anything could differ (fewer rows, where
bitsandbytes runs its fused kernel; hooks on the layer; its first call; a bias that trains; another bitsandbytes
version; ``torch.func``) the layer's own forward runs.

The forward's dense weight is also the one a norm-cache miss of the same layer needs: ``held`` hands it over (the
miss then dequantizes nothing), and ``release`` drops it once the layer's call is done.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashdora import backend, layers

# Devices where ``result`` takes the path (where the dequantization runs from C++); tests add "cpu", where
# bitsandbytes' default ``gemm_4bit`` dequantizes at every size.
DEVICES = ("cuda",)
_held: tuple | None = None  # (packed's data_ptr, its version, quant_state, dense weight) of the last forward


def _cuda_rows() -> int | None:
    """Rows above which bitsandbytes 0.50's CUDA ``gemm_4bit`` dequantizes and calls ``F.linear``; ``None`` on an
    untested version or where its (private) threshold is not found."""
    try:
        import bitsandbytes as bnb

        version = tuple(int(p) for p in bnb.__version__.split(".")[:2])
        if not layers._BNB_KERNELS_TESTED[0] <= version < layers._BNB_KERNELS_TESTED[1] or torch.version.hip:
            return None
        from bitsandbytes.backends.cuda import ops

        rows = getattr(ops, "_gemm_4bit_custom_max_m", None)
        return rows if isinstance(rows, int) else None
    except (ImportError, ValueError, AttributeError):
        return None


_ROWS: dict[str, int | None] = {}
_FORWARD: list = []  # bitsandbytes' Linear4bit.forward, once bitsandbytes is imported


def _min_rows(device_type: str) -> int | None:
    if device_type not in _ROWS:
        _ROWS[device_type] = _cuda_rows() if device_type == "cuda" else 0
    return _ROWS[device_type]


def _plain_module(base) -> bool:
    """Whether calling ``base`` runs exactly bitsandbytes' ``Linear4bit.forward`` (no hooks, no replaced forward)."""
    if not _FORWARD:
        import bitsandbytes as bnb

        _FORWARD.append(bnb.nn.Linear4bit.forward)
    if type(base).forward is not _FORWARD[0] or "forward" in base.__dict__:
        return False
    if base._forward_hooks or base._forward_pre_hooks or base._backward_hooks or base._backward_pre_hooks:
        return False
    hooks = torch.nn.modules.module  # global hooks (private names, read with a default: none found means "maybe")
    return not any(getattr(hooks, name, True) for name in _GLOBAL_HOOKS)


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")  # fmt: skip


def _plan(base, x):
    """``(x in the compute dtype, packed alias, quant_state, bias)`` where ``result`` takes the path, else ``None``."""
    if x.device.type not in DEVICES or type(base).__name__ != "Linear4bit" or not _plain_module(base):
        return None
    if not base.compute_type_is_set or torch.compiler.is_compiling() or backend.functorch_active():
        return None
    weight = layers.param(base, "weight")
    state = getattr(weight, "quant_state", None)
    rows = _min_rows(x.device.type)
    if state is None or rows is None or getattr(state, "packing_format_for_cpu", False) or len(state.shape) != 2:
        return None
    k = x.shape[-1]
    if k != state.shape[1] or x.numel() // max(k, 1) <= rows or x.numel() == 0:
        return None
    cd = base.compute_dtype
    if (x.dtype if cd is None else cd) != state.dtype or weight.device != x.device:
        return None  # (bitsandbytes dequantizes into the input's dtype; the C++ path, into the state's)
    bias = layers.param(base, "bias")
    if bias is not None and (bias.requires_grad or bias.dtype != state.dtype):
        return None  # (bitsandbytes then casts the bias in place, or trains it)
    packed = weight.detach()
    if packed.is_cuda and layers._native_4bit(packed, state) is None:
        return None  # no C++ dequantization here: nothing to gain
    return (x if cd is None else x.to(cd)), packed, state, bias


def _dense(packed, state) -> torch.Tensor:
    out = layers._native_dequantize_4bit(packed, state) if packed.is_cuda else None
    if out is None:
        import bitsandbytes as bnb

        out = bnb.functional.dequantize_4bit(packed, state)
    return out


class _Linear4bit(torch.autograd.Function):
    """``F.linear(x, W, bias)`` with ``W`` dequantized in the forward and again in the backward (never saved)."""

    @staticmethod
    def forward(ctx, x, packed, state, bias):
        global _held
        w = _dense(packed, state)
        _held = (packed.data_ptr(), packed._version, state, w)
        ctx.save_for_backward(packed)  # (an in-place write into the packed weight before backward raises)
        ctx.state = state
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (packed,) = ctx.saved_tensors
        return torch.matmul(grad, _dense(packed, ctx.state).to(grad.dtype)), None, None, None


def result(base, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(base(x), fresh)``: ``fresh`` when flashdora computed it (a new tensor), else it is the layer's own call."""
    plan = _plan(base, x) if layers.is_bnb(base) else None
    if plan is None:
        return base(x), False
    backend.count("base:4bit")
    xc, packed, state, bias = plan
    if torch.is_grad_enabled() and xc.requires_grad:
        out = _Linear4bit.apply(xc, packed, state, bias)
    else:
        global _held
        w = _dense(packed, state)
        _held = (packed.data_ptr(), packed._version, state, w)
        out = F.linear(xc, w, bias)
    return out.to(x.dtype), True


def held(packed: torch.Tensor, state) -> torch.Tensor | None:
    """The dense weight the last ``result`` dequantized, if it is ``packed``'s under ``state`` at its version now."""
    got = _held
    if got is None or got[2] is not state or got[0] != packed.data_ptr() or got[1] != packed._version:
        return None
    return got[3]


def release() -> None:
    """Drop the held dense weight (the end of a layer's call)."""
    global _held
    _held = None
