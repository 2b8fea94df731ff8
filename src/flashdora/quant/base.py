"""The base result of a bitsandbytes layer: bitsandbytes' own calls, without the Python around them.

bitsandbytes' layers reach their kernels through several Python layers each call (the module's checks, a ``matmul``
function, an autograd Function, op dispatches), three times a layer and training step with checkpointing, on a host
that paces an 8B QDoRA step. On a flashdora DoRA layer, ``run`` makes the same calls (as ``plan`` decided):

- ``Linear4bit``: past ``_gemm_4bit_custom_max_m`` rows (1536 on CUDA in bitsandbytes 0.50) its ``gemm_4bit`` op
  dequantizes the weight and calls ``F.linear``, and its backward dequantizes again for ``grad_x``. Here the weight
  is dequantized by bitsandbytes' own kernels launched from C++ (``native.bridge``, which ``dispatch`` passes in),
  then ``F.linear`` with the same operands, and a backward that dequantizes again. The forward's dense weight is
  also the one a norm-cache miss of the same layer needs: ``dequant.kept_dense`` hands it over (the miss then
  dequantizes nothing), and ``release`` drops it once the layer's call is done.
- ``Linear8bitLt`` (a frozen int8 weight): its forward quantizes the input row-wise to int8 and calls the
  ``int8_scaled_mm`` op (``int8_mixed_scaled_mm`` above an outlier threshold); its backward dequantizes ``CB`` to the
  input's dtype for ``grad_x``. Here the same ops and the same backward.

Wherever anything could differ (fewer rows, where bitsandbytes runs its fused 4-bit kernel; hooks on the layer;
a bias that trains or needs a cast; another bitsandbytes version; ``torch.func``; bitsandbytes' CPU
training path) the layer's own forward runs, as it does everywhere with ``FLASHDORA_PRIVATE_APIS=0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashdora import backend
from flashdora.peft import support
from flashdora.quant import dequant
from flashdora.quant.dequant import release  # noqa: F401 (peft.layers calls quant.base.release)

# Devices where ``plan`` takes the path (CUDA, where the 4-bit dequantization runs from C++); tests add "cpu",
# where bitsandbytes' default ``gemm_4bit`` dequantizes at every size.
DEVICES = ("cuda",)


def _tested() -> bool:
    """Whether this bitsandbytes is a version ``run`` was tested with (``dequant.bnb_tested``; not ROCm)."""
    if "tested" not in _CACHE:
        _CACHE["tested"] = dequant.bnb_tested() and not torch.version.hip
    return _CACHE["tested"]


def _cuda_rows() -> int | None:
    """Rows above which bitsandbytes' CUDA ``gemm_4bit`` dequantizes and calls ``F.linear``; ``None`` on an
    untested version or where its (private) threshold is not found."""
    if not _tested():
        return None
    try:
        from bitsandbytes.backends.cuda import ops

        rows = getattr(ops, "_gemm_4bit_custom_max_m", None)
        return rows if isinstance(rows, int) else None
    except (ImportError, AttributeError):
        return None


_CACHE: dict = {}
_ROWS: dict[str, int | None] = {}
_FORWARDS: dict[str, object] = {}  # bitsandbytes' Linear4bit.forward and Linear8bitLt.forward, once imported


def _min_rows(device_type: str) -> int | None:
    if device_type not in _ROWS:
        _ROWS[device_type] = _cuda_rows() if device_type == "cuda" else 0
    return _ROWS[device_type]


def _plain_module(base) -> bool:
    """Whether calling ``base`` runs exactly bitsandbytes' own forward of its class (no hooks, no replaced forward)."""
    name = type(base).__name__
    if name not in _FORWARDS:
        import bitsandbytes as bnb

        _FORWARDS[name] = getattr(bnb.nn, name).forward
    if type(base).forward is not _FORWARDS[name] or "forward" in base.__dict__:
        return False
    return support.hooked(base) is None


def _free(base, x) -> bool:
    """The conditions both paths share: a device they run on, bitsandbytes' own forward, no compile or transform,
    private internals allowed (``FLASHDORA_PRIVATE_APIS``: the hooks' and bitsandbytes' private names)."""
    return (
        x.device.type in DEVICES and x.numel() > 0 and backend.private_apis() and _plain_module(base)
        and not torch.compiler.is_compiling() and not backend.functorch_active()
    )  # fmt: skip


def _plan4(base, x, fast):
    """``(x in the compute dtype, packed alias, quant_state, bias, fast)`` where ``run`` takes the 4-bit path."""
    if not _tested() or not _free(base, x):
        return None
    _first_call_4bit(base, x)
    weight = support.param(base, "weight")
    state = getattr(weight, "quant_state", None)
    rows = _min_rows(x.device.type)
    if state is None or rows is None or getattr(state, "packing_format_for_cpu", False) or len(state.shape) != 2:
        return None
    k = x.shape[-1]
    if k != state.shape[1] or x.numel() // max(k, 1) <= rows:
        return None
    cd = base.compute_dtype
    if (x.dtype if cd is None else cd) != state.dtype or weight.device != x.device:
        return None  # (bitsandbytes dequantizes into the input's dtype; the C++ path, into the state's)
    bias = support.param(base, "bias")
    if bias is not None and (bias.requires_grad or bias.dtype != state.dtype):
        return None  # (bitsandbytes then casts the bias in place, or trains it)
    packed = weight.detach()
    if packed.is_cuda and (fast is None or fast.takes_4bit(packed, state) is None):
        return None  # no C++ dequantization for this call: nothing to gain
    return (x if cd is None else x.to(cd)), packed, state, bias, fast


def _first_call_4bit(base, x) -> None:
    """What ``Linear4bit.forward`` does to the layer before its product (bitsandbytes 0.50): the quant state put back
    on the weight, the compute dtype set from the first input. Done here too, so that the layer's first call takes the
    route every later call takes: a checkpointed forward and its recomputation must save the same tensors."""
    if getattr(support.param(base, "weight"), "quant_state", None) is None:
        from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

        fix_4bit_weight_quant_state_from_module(base)
    if not base.compute_type_is_set:
        base.set_compute_type(x)
        base.compute_type_is_set = True


def _first_call_8bit(base) -> None:
    """``Linear8bitLt.forward``'s first-call work (bitsandbytes 0.50): the int8 weight and its scales moved into the
    layer's state, the weight's data then the state's ``CB``. Done here too, for the reason ``_first_call_4bit``
    gives."""
    weight = support.param(base, "weight")
    if getattr(weight, "CB", None) is not None:
        base.init_8bit_state()
        if not base.state.has_fp16_weights and base.state.CB is not None:
            weight.data = base.state.CB


class _Linear4bit(torch.autograd.Function):
    """``F.linear(x, W, bias)`` with ``W`` dequantized in the forward and again in the backward (never saved)."""

    @staticmethod
    def forward(ctx, x, packed, state, bias, fast):
        w = dequant.keep_dense(packed, state, fast)
        ctx.save_for_backward(packed)  # (an in-place write into the packed weight before backward raises)
        ctx.state, ctx.fast = state, fast
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        (packed,) = ctx.saved_tensors
        w = dequant.dequantize_4bit(packed, ctx.state, ctx.fast)
        return torch.matmul(grad, w.to(grad.dtype)), None, None, None, None


def _plan8(base, x):
    """``(CB, SCB, bias, state)`` where ``run`` takes the 8-bit path, else ``None``."""
    if not _tested() or not _free(base, x) or x.dim() not in (2, 3):
        return None
    _first_call_8bit(base)
    state, weight = base.state, support.param(base, "weight")
    cb, scb = state.CB, state.SCB
    if cb is None or scb is None or getattr(weight, "CB", None) is not None or weight.requires_grad:
        return None  # (the layer's first call moves CB into its state)
    if state.has_fp16_weights or cb.device != x.device or x.shape[-1] != cb.shape[1]:
        return None
    if base.training and x.device.type in ("cpu", "xpu"):
        return None  # bitsandbytes trains through MatMul8bitFp there
    bias = support.param(base, "bias")
    if bias is not None and (bias.requires_grad or bias.dtype != x.dtype):
        return None
    return cb, scb, bias, state


_OPS: list = []  # bitsandbytes' int8_vectorwise_quant, int8_scaled_mm and int8_mixed_scaled_mm ops


def _int8_linear(x, cb, scb, bias, state):
    """``MatMul8bitLt.forward``'s output: ``x`` quantized row-wise (through float16), the int8 product scaled back to
    ``x``'s dtype, plus ``bias``; with an outlier threshold (LLM.int8()), the outlier columns of ``x`` in its own
    dtype, recorded on the state as bitsandbytes' forward records them."""
    if not _OPS:
        ops = torch.ops.bitsandbytes
        _OPS.extend((ops.int8_vectorwise_quant.default, ops.int8_scaled_mm.default, ops.int8_mixed_scaled_mm))
    a = x.reshape(-1, x.shape[-1]) if x.dim() == 3 else x
    threshold = state.threshold
    ca, sca, outliers = _OPS[0](a.to(torch.float16), threshold)
    if threshold > 0.0:
        state.idx = outliers
        out = _OPS[2](a, ca, cb, sca, scb, outliers, bias)[0]
    else:
        out = _OPS[1](ca, cb, sca, scb, bias=bias, dtype=a.dtype)
    return out.reshape(*x.shape[:-1], cb.shape[0]) if x.dim() == 3 else out


class _Linear8bit(torch.autograd.Function):
    """``_int8_linear`` with ``MatMul8bitLt``'s backward for ``x``: ``grad @ (CB * (SCB / 127))`` in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x, cb, scb, bias, state):
        ctx.save_for_backward(cb, scb)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return _int8_linear(x, cb, scb, bias, state)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        cb, scb = ctx.saved_tensors
        if grad.dim() == 3:
            grad = grad.reshape(-1, grad.shape[-1]).contiguous()
        w = cb.to(ctx.dtype, copy=True).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))
        return torch.matmul(grad.to(ctx.dtype), w).view(ctx.shape), None, None, None, None


def plan(base, x: torch.Tensor, fast=None) -> tuple | None:
    """How this call of a bitsandbytes layer ``base`` makes its base result, decided once (``dispatch.base_plan``):
    ``("4bit", ...)`` or ``("8bit", ...)`` (bitsandbytes' ops without its Python), ``None`` (the layer's own call).
    ``fast``: the C++ 4-bit dequantization (``native.bridge``) on the ``native`` route, else ``None``."""
    dequant.release()  # (a call that did not end, e.g. checkpointing's early stop, may have left one)
    name = type(base).__name__
    if name == "Linear4bit":
        got = _plan4(base, x, fast)
        return None if got is None else ("4bit", got)
    if name == "Linear8bitLt":
        got = _plan8(base, x)
        return None if got is None else ("8bit", got)
    return None


def run(base, x: torch.Tensor, how: tuple | None) -> tuple[torch.Tensor, bool]:
    """``(base(x), fresh)`` as ``plan`` decided: ``fresh`` when flashdora computed it (a new tensor), else it is the
    layer's own call. The caller ``release``s once the layer's call is done."""
    if how is None:
        return base(x), False
    kind, args = how
    if kind == "4bit":
        return _result4(x, *args), True
    backend.count("base:8bit")
    base.state.is_training = base.training  # (as the layer's forward sets it)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Linear8bit.apply(x, *args), True
    return _int8_linear(x, *args), True


def _result4(x, xc, packed, state, bias, fast):
    backend.count("base:4bit")
    if torch.is_grad_enabled() and xc.requires_grad:
        out = _Linear4bit.apply(xc, packed, state, bias, fast)
    else:
        out = F.linear(xc, dequant.keep_dense(packed, state, fast), bias)
    return out.to(x.dtype)
