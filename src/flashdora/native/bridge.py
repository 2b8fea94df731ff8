"""The layer path's calls into the C++ extension (``native.build`` loads it): the compose (or the whole layer on a
plain base), the norm-cache miss, the 4-bit dequantization and the mixed layers' kept-stack check. Callers never see
the extension's own answers (a result, ``None`` for "not mine", ``False`` for "no plan yet").

Prime, then run: the C++ side replays launches of Triton kernels that Python compiled. At a call it has no plan for
(a shape's first call, a new token count), ``prime`` compiles the forward and the backward kernel on scratch tensors
and files both plans before the call runs in C++, so every training call on the ``native`` route hangs the C++ node:
a checkpointed forward and its recomputation save the same tensors. A call the C++ side declines for a fixed property
(alignment, a trainable bias) runs the Python Triton path every time.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from flashdora import backend, config
from flashdora._dtypes import cast, compute_dtype
from flashdora.native import build


def compose(result, lx, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base, seq, python):
    """The compose on the ``native`` route: the C++ forward (with grad, its C++ node on the output); a call it has
    no plan for is primed (``prime``) and run again; one it declines runs ``python("triton", ...)``."""
    mod = build._module
    args = (result, lx, lora_A, lora_B, magnitude, scales, bias, float(scaling), seq, lx_base)
    y = mod.forward(*args)
    if y is False and prime(mod, result, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base):
        y = mod.forward(*args)
    if y is None or y is False:
        if torch.is_grad_enabled() and magnitude.requires_grad:
            backend.count("native_declined")  # (the same calls every time: the Python node)
        return python("triton", result, lx, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base, seq)
    backend.count("triton")
    if torch.is_grad_enabled():
        backend.count("native_backward")
    return y


def layer(x, weight, bias, lora_A, lora_B, magnitude, scales, scaling):
    """A layer call on the ``native`` route with a ``native`` base (``native/csrc/layer.cpp``): the base matmul, the
    LoRA A matmul and the compose in one C++ call, with one C++ node in training; a call it has no plan for is primed
    and run again. ``None`` where the C++ side declines it (the caller runs the base layer and the C++ compose)."""
    mod = build._module
    args = (x, weight, bias, lora_A, lora_B, magnitude, scales, float(scaling))
    y = mod.layer_forward(*args)
    if y is False:
        like = x.new_zeros((x.numel() // x.shape[-1], weight.shape[0]))  # stands in for the base's result
        if prime(mod, like, lora_A, lora_B, magnitude, scales, scaling, bias, None):
            y = mod.layer_forward(*args)
    if y is None or y is False:
        return None
    backend.count("triton")
    backend.count("native_layer")
    if torch.is_grad_enabled():
        backend.count("native_backward")
    return y


# calls whose kernels gave no plan (an interpreter, an unknown Triton): not primed again
_UNPLANNED: set[tuple] = set()


def prime(mod, result, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base) -> bool:
    """File with ``mod`` the plans of the forward kernel and, in training, of the backward kernel, for calls like
    this one, compiling each on scratch tensors first where Python has not yet; whether both are filed."""
    from flashdora.kernels import compose as kc
    from flashdora.native import plans

    train = torch.is_grad_enabled() and magnitude.requires_grad
    n = result.shape[-1]
    t = result.numel() // n if n else 0
    has_lx = lx_base is not None
    device_type = result.device.type
    cd = compute_dtype(device_type, lora_A, torch.is_autocast_enabled(device_type))
    key = (t, n, lora_A.shape[0], result.dtype, cd, lora_B.dtype, scales.dtype, bias is not None, has_lx, train)
    if key in _UNPLANNED:
        return False
    with torch.no_grad():
        a = result.new_zeros((t, lora_A.shape[0]), dtype=cd)  # stands in for x A^T: plans read dtypes and alignment
        b = cast(lora_B, cd) if kc.cast_b_first(lora_B, t) else lora_B
        fwd = plans.compose_fwd(result, a, b, scales, scaling, bias, train, lx_base)
        if fwd is None:  # compile (and tune) the forward kernel: outputs discarded
            kc.compose_fwd_fused(result, a, b, scales, scaling, bias, lx_base, save_inner=train)
            fwd = plans.compose_fwd(result, a, b, scales, scaling, bias, train, lx_base)
        bwd = plans.compose_bwd(t, n, result.dtype, scales, has_lx) if train else ()
        if bwd is None:  # the backward kernel, on zeros shaped like its gradients
            dy = torch.zeros_like(result, memory_format=torch.contiguous_format)
            kc.compose_bwd(dy, dy, scales, has_lx)
            bwd = plans.compose_bwd(t, n, result.dtype, scales, has_lx)
    if fwd is None or bwd is None:
        _UNPLANNED.add(key)
        return False
    mod.register_forward(result, a, b, scales, bias, train, *fwd, lx_base=lx_base)
    if train:
        # (stand-ins of what the key reads: the result's shape, dtype and device, the scales' dtype and row stride)
        like = result.new_empty(1).expand(t, n)
        like_scales = scales.new_empty(1).as_strided((1, 1), (scales.stride(0), 1))
        mod.register_backward(like, like_scales, *bwd, has_lx_base=has_lx)
    return True


def norm_scales(weight, lora_A, lora_B, magnitude, scaling, w_sq, python):
    """A norm-cache miss on the ``native`` route: the C++ replay of the Triton norm's launches once planned, else
    ``python()`` (the Triton path), which compiles what the plan needs and is then filed. ``(norm, scales)``. (The
    norm records nothing for autograd: which of the two ran never changes what a backward sees.)"""
    from flashdora.kernels import norm_small

    mod = build._module
    got = mod.norm_scales(weight, lora_A, lora_B, magnitude, w_sq, float(scaling), norm_small.MAX_R)
    if got is not None and got is not False:
        backend.count("norm:native")
        return got
    out = python()
    if got is False:  # no plan for layers like this one yet: the Python path has just compiled what it needs
        _file_norm_plan(mod, weight, lora_A, lora_B, magnitude)
    return out


def _file_norm_plan(mod, weight, lora_A, lora_B, magnitude) -> bool:
    """Files with the extension how ``norm_and_scales`` launched for this layer (its small-rank kernel, with the
    scales kernel where it splits d_in, or ``norm_gemm``'s epilogue and the scales kernel); whether it did."""
    from flashdora.kernels import norm_small
    from flashdora.native import plans

    small = norm_small.takes(weight, lora_A)
    plan = (plans.norm_small_miss if small else plans.norm_gemm_miss)(weight, lora_A, lora_B, magnitude)
    if plan is None:
        return False
    (mod.register_norm_small if small else mod.register_norm)(weight, lora_A, lora_B, magnitude, *plan)
    return True


def held_unchanged(held) -> bool | None:
    """``peft.mixed``'s kept-pack check in C++ (``native/csrc/check.cpp``) where the extension is loaded and switched
    on, else ``None`` (the caller runs its Python passes). ``held``: a ``peft.mixed._Held``."""
    mod = build._module
    if mod is None or not build.enabled():
        return None
    return mod.held_unchanged(held.tensors, held.owners, held.versions, held.ptrs, held.parents, held.modules,
                              held.types, held.dicts)  # fmt: skip


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@functools.cache
def bnb_kernel(name: str) -> int:
    """The address of a kernel wrapper bitsandbytes' library exports (``cdequantize_blockwise_bf16_nf4``...), or 0:
    not a tested bitsandbytes version (``config.TESTED``; the signatures are its library's, not a public API),
    no CUDA library, no such symbol."""
    try:
        from bitsandbytes.cextension import lib

        if not config.bnb_tested() or not getattr(lib, "compiled_with_cuda", 0):
            return 0
        fn = getattr(getattr(lib, "_lib", None), name, None)
        if fn is None:
            return 0
        return ctypes.cast(fn, ctypes.c_void_p).value or 0
    except (ImportError, ValueError, AttributeError, TypeError):
        return 0


def takes_4bit(packed: torch.Tensor, state):
    """``(module, 4-bit kernel address, blockwise kernel address or 0)`` of the C++ 4-bit dequantization for
    ``packed`` (the blockwise one for a nested state's absmax), or ``None`` where it does not run (CPU, switched off,
    not loaded, another dtype or quantization, an unexpected nested state, an untested bitsandbytes)."""
    if not packed.is_cuda or packed.shape[0] == 1 or packed.dtype != torch.uint8 or not packed.is_contiguous():
        return None  # (another quant_storage, e.g. FSDP-QLoRA's bf16: bitsandbytes' own function)
    mod = build._module
    dtype = _DTYPE_NAMES.get(state.dtype)
    if mod is None or not build.enabled() or dtype is None or state.quant_type not in ("nf4", "fp4"):
        return None
    fn_blockwise = 0
    if state.nested:
        inner, offset = state.state2, state.offset
        if not isinstance(offset, torch.Tensor) or inner.dtype != torch.float32 or inner.nested:
            return None
        fn_blockwise = bnb_kernel("cdequantize_blockwise_fp32")
        if not fn_blockwise:
            return None
    fn_4bit = bnb_kernel(f"cdequantize_blockwise_{dtype}_{state.quant_type}")
    return (mod, fn_4bit, fn_blockwise) if fn_4bit else None


def dequantize_4bit(packed: torch.Tensor, state) -> torch.Tensor | None:
    """bitsandbytes' ``dequantize_4bit(packed, state)`` from C++ (``native/csrc/norm.cpp``: its library's kernels,
    the same bits), or ``None`` where that path does not run (``takes_4bit``)."""
    plan = takes_4bit(packed, state)
    if plan is None:
        return None
    mod, fn_4bit, fn_blockwise = plan
    if not state.nested:
        return mod.dequantize_4bit(packed, state.absmax, state.blocksize, list(state.shape), state.dtype, fn_4bit,
                                   None, None, None, 0, 0)  # fmt: skip
    inner = state.state2
    return mod.dequantize_4bit(packed, state.absmax, state.blocksize, list(state.shape), state.dtype, fn_4bit,
                               inner.code, inner.absmax, state.offset, inner.blocksize, fn_blockwise)  # fmt: skip
