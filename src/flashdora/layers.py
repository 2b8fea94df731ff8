"""Which DoRA Linear layers flashdora runs, and why not the others (``unsupported_reason``), plus the accessors the
per-call forward uses: submodules and parameters read from the modules' own dicts."""

from __future__ import annotations

import ctypes
import functools

import torch
from peft.tuners.lora.layer import LoraLayer
from torch import nn
from transformers.pytorch_utils import Conv1D

from flashdora import backend

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def unsupported_reason(module: LoraLayer, adapter: str) -> str | None:
    """Why flashdora cannot run this DoRA Linear layer (``None`` when it can)."""
    mods = module._modules
    base = base_layer(module)
    lora_B_layer = mods["lora_B"]._modules[adapter]
    why = reason(
        base, param(base, "weight"), param(mods["lora_A"]._modules[adapter], "weight"), lora_B_layer,
        param(lora_B_layer, "weight"), param(mods["lora_magnitude_vector"]._modules[adapter], "weight"),
    )  # fmt: skip
    hook = None if why is not None else hooked_adapter(module, adapter)  # (flash_forward's order: its answer)
    return why if hook is None else f"hooks:{hook}"


# The forward runs once per layer call, where host time is the bottleneck: it reads submodules and parameters from
# the modules' own dicts. ``nn.Module.__getattr__`` costs a Python call per attribute, and PEFT's
# ``get_base_layer`` a caught AttributeError per call (about 2 and 5 us on a laptop CPU, against 0.15).


def base_layer(module: nn.Module) -> nn.Module:
    """PEFT's ``get_base_layer``: the innermost ``base_layer`` (nested when LoRA layers wrap LoRA layers)."""
    while "base_layer" in module._modules:
        module = module._modules["base_layer"]
    return module


def param(module: nn.Module, name: str):
    """``getattr(module, name)`` for a registered parameter, without ``nn.Module.__getattr__``."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name, None)


# Process-wide module hooks (``register_module_forward_hook`` and its kind) live in private dicts of
# ``torch.nn.modules.module``, present in every torch the tests cover; where one is missing, "maybe": every call
# then runs PEFT's own forward.
_GLOBAL_HOOKS = tuple(
    getattr(nn.modules.module, name, {None: None})
    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
)  # fmt: skip
_PLAIN_FORWARDS = {nn.Linear.forward}


def global_hooks() -> bool:
    """Whether a process-wide module hook is registered, other than flashdora's own (``watch``'s FSDP2 pre-hook,
    marked ``_flashdora_own``: it needs no adapter module called)."""
    forward, pre, backward, backward_pre = _GLOBAL_HOOKS
    if pre and not all(getattr(hook, "_flashdora_own", False) for hook in pre.values()):
        return True
    return bool(forward or backward or backward_pre)


def hooked(*modules: nn.Module) -> str | None:
    """The first of ``modules`` that PEFT's DoRA would call with something flashdora would skip: a forward,
    pre-forward or backward hook (``weight_norm``'s legacy form is a pre-forward hook), or a forward other than
    ``nn.Linear``'s (an instance ``forward``, a subclass). Its ``_get_name()``, ``"global"`` for a process-wide
    hook, else ``None``. flashdora reads these modules' weights instead of calling them."""
    for module in modules:
        if (
            module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
            or module._backward_pre_hooks or "forward" in module.__dict__
        ):  # fmt: skip
            return module._get_name()
    return "global" if global_hooks() else None


def hooked_adapter(module: nn.Module, adapter: str) -> str | None:
    """``hooked`` for the ``lora_A``, ``lora_B`` and magnitude modules of ``module``'s ``adapter``; lora_A's and
    lora_B's class must run ``nn.Linear``'s forward."""
    mods = module._modules
    lora_A, lora_B = mods["lora_A"]._modules[adapter], mods["lora_B"]._modules[adapter]
    for layer in (lora_A, lora_B):
        if type(layer).forward not in _PLAIN_FORWARDS:
            return layer._get_name()
    return hooked(lora_A, lora_B, mods["lora_magnitude_vector"]._modules[adapter])


_BNB_LAYERS = ("Linear4bit", "Linear8bitLt")  # bitsandbytes' quantized layers (QDoRA): class names, no bnb import


def is_bnb(base) -> bool:
    """Whether ``base`` is a bitsandbytes 4-bit or 8-bit Linear layer."""
    kind = type(base)
    return kind.__name__ in _BNB_LAYERS and kind.__module__.startswith("bitsandbytes")


def dequantized(base, packed: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A bitsandbytes layer's weight as the dense tensor its own forward computes with (PEFT's dequantization).

    A 4-bit weight is what ``bitsandbytes.functional.dequantize_4bit`` makes of it, the call PEFT's
    ``dequantize_module_weight`` makes for it (and ``Linear4bit``'s forward), without PEFT's checks around it: a
    cache miss runs this every optimizer step, and those checks read ``Params4bit`` attributes through its
    ``__torch_function__`` (about 60 us of the host's time per call on the dev machine's CPU). On CUDA, with the C++
    extension built and a bitsandbytes version it was tested with, the same kernels of bitsandbytes' library run from
    C++ (``_native_dequantize_4bit``: the same bits, a fraction of the host time); where flashdora computed the
    layer's base result itself (``bnb_base``), the weight that forward dequantized. An 8-bit weight comes in
    ``dtype`` (default float32), the values of PEFT's float32 dequantization cast to it (``_dequantize_int8``).
    ``packed``: a plain alias of the packed weight (``weight.detach()``), if the caller has one."""
    weight = base.weight
    with torch.no_grad():
        kind = type(weight).__name__
        if kind == "Params4bit" and getattr(weight, "quant_state", None) is not None:
            packed = weight.data if packed is None else packed
            from flashdora import bnb_base

            out = bnb_base.held(packed, weight.quant_state)  # the layer's forward has just dequantized it
            return dequantize_4bit(packed, weight.quant_state) if out is None else out
        if kind == "Int8Params":
            out = _dequantize_int8(base, weight.data if packed is None else packed, dtype or torch.float32)
            if out is not None:
                return out
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(base)


def dequantize_4bit(packed: torch.Tensor, state) -> torch.Tensor:
    """``bitsandbytes.functional.dequantize_4bit(packed, state)``: from C++ where ``_native_dequantize_4bit`` runs
    (the same bits), else that function itself."""
    out = _native_dequantize_4bit(packed, state)
    if out is None:
        import bitsandbytes as bnb

        out = bnb.functional.dequantize_4bit(packed, state)
    return out


_INT8_SCALE = 7.874015718698502e-3  # 1 / 127, as bitsandbytes' int8_vectorwise_dequant writes it
_INT8_CHUNK = 16 * 1024 * 1024  # float32 elements of one row chunk's transient (64 MiB)


def _dequantize_int8(base, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """An ``Int8Params`` weight ``CB * SCB / 127`` in ``dtype``, or ``None`` (not quantized: PEFT's function).

    The values are bitsandbytes' ``int8_vectorwise_dequant(CB, SCB)`` (float32, the weight PEFT's DoRA dequantizes
    and casts to its input's dtype) cast to ``dtype``, computed in the same order. A 16-bit ``dtype`` on the Triton
    path is one kernel (``kernels/dequant.py``: no float32 tensor at all); elsewhere it is filled a row chunk at a
    time, so no float32 ``[d_out, d_in]`` tensor exists, only a chunk of at most 64 MiB. It reads
    ``SCB`` from the layer's state or the parameter without writing either (PEFT's CPU path re-assigns the weight,
    after which bitsandbytes' forward finds no scales)."""
    state = getattr(base, "state", None)
    scb = getattr(state, "SCB", None)
    scb = getattr(base.weight, "SCB", None) if scb is None else scb
    if data.dtype != torch.int8 or data.dim() != 2 or scb is None:
        return None
    scb = scb.to(data.device)
    if backend.use_triton(data):
        from flashdora.kernels import dequant

        if dequant.takes(data, scb, dtype):
            return dequant.int8_to(data, scb, dtype, _INT8_SCALE)
    scb = scb.view(-1, 1)
    if dtype == torch.float32:
        return data * scb * _INT8_SCALE
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    rows = max(1, _INT8_CHUNK // max(1, data.shape[1]))
    for i in range(0, data.shape[0], rows):
        torch.mul(data[i : i + rows] * scb[i : i + rows], _INT8_SCALE, out=out[i : i + rows])
    return out


_BNB_KERNELS_TESTED = ((0, 50), (0, 51))  # bitsandbytes versions whose exported kernels the C++ path calls
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def bnb_tested() -> bool:
    """Whether the installed bitsandbytes is a version flashdora's uses of its internals were tested with
    (``_BNB_KERNELS_TESTED``)."""
    try:
        import bitsandbytes as bnb

        version = tuple(int(p) for p in bnb.__version__.split(".")[:2])
    except (ImportError, ValueError):
        return False
    return _BNB_KERNELS_TESTED[0] <= version < _BNB_KERNELS_TESTED[1]


@functools.cache
def bnb_kernel(name: str) -> int:
    """The address of a kernel wrapper bitsandbytes' library exports (``cdequantize_blockwise_bf16_nf4``...), or 0:
    not a tested bitsandbytes version (``_BNB_KERNELS_TESTED``; the signatures are its library's, not a public API),
    no CUDA library, no such symbol."""
    try:
        from bitsandbytes.cextension import lib

        if not bnb_tested() or not getattr(lib, "compiled_with_cuda", 0):
            return 0
        fn = getattr(getattr(lib, "_lib", None), name, None)
        if fn is None:
            return 0
        return ctypes.cast(fn, ctypes.c_void_p).value or 0
    except (ImportError, ValueError, AttributeError, TypeError):
        return 0


def _native_4bit(packed: torch.Tensor, state):
    """``(module, 4-bit kernel address, blockwise kernel address or 0)`` of the C++ 4-bit dequantization for
    ``packed`` (the blockwise one for a nested state's absmax), or ``None`` where it does not
    run (CPU, switched off, still building, another dtype or quantization, an unexpected nested state, a
    bitsandbytes version it was not tested with)."""
    from flashdora import native

    if not packed.is_cuda or packed.shape[0] == 1 or packed.dtype != torch.uint8 or not packed.is_contiguous():
        return None  # (another quant_storage, e.g. FSDP-QLoRA's bf16: bitsandbytes' own function)
    if not native.enabled():
        return None
    mod = native.module(wait=False)
    dtype = _DTYPE_NAMES.get(state.dtype)
    if mod is None or dtype is None or state.quant_type not in ("nf4", "fp4"):
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


def _native_dequantize_4bit(packed: torch.Tensor, state) -> torch.Tensor | None:
    """``dequantize_4bit(packed, state)`` from C++ (``csrc/norm.cpp``), or ``None`` where that path does not run."""
    plan = _native_4bit(packed, state)
    if plan is None:
        return None
    mod, fn_4bit, fn_blockwise = plan
    if not state.nested:
        return mod.dequantize_4bit(packed, state.absmax, state.blocksize, list(state.shape), state.dtype, fn_4bit,
                                   None, None, None, 0, 0)  # fmt: skip
    inner = state.state2
    return mod.dequantize_4bit(packed, state.absmax, state.blocksize, list(state.shape), state.dtype, fn_4bit,
                               inner.code, inner.absmax, state.offset, inner.blocksize, fn_blockwise)  # fmt: skip


def _sharded(t) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 parameter between forwards)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def reason(base, weight, lora_A, lora_B_layer, lora_B, magnitude) -> str | None:
    """``unsupported_reason`` from the layer's parts, as the forward has them in hand."""
    if hasattr(weight, "ds_id") or hasattr(lora_A, "ds_id"):  # DeepSpeed ZeRO-3: empty outside its hooks' gathers
        return "deepspeed_zero3"
    if not isinstance(base, (nn.Linear, Conv1D)):
        return f"base:{type(base).__name__}"
    if (type(weight) not in (nn.Parameter, torch.Tensor) or weight.dtype not in _FLOATS) and not is_bnb(base):
        if not (_sharded(weight) and weight.dtype in _FLOATS):  # FSDP2 at rest: its forward sees the gathered weight
            return f"quantized:{type(base).__name__}"
    if param(lora_B_layer, "bias") is not None:
        return "lora_bias"
    device = weight.device
    if lora_A.device != device or lora_B.device != device or magnitude.device != device:
        return "devices:adapter and base weight on different devices"
    return None
