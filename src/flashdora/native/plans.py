"""Plans: how the C++ side launches a Triton kernel that Python has tuned and compiled (``kernels.launcher``).

A plan is ``(tuned config, CUfunction, warps, shared bytes, parameter types, kept argument positions)`` read from the
launcher's tables, or ``None`` until a Python call has compiled the kernel for calls like this one (and wherever it
runs through Triton's launcher rather than torch's). Plans depend on dtypes, alignment and integer specialization,
never on values: the builders below pass stand-in tensors of the right dtype and alignment.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime.autotuner import Heuristics

from flashdora import backend
from flashdora.kernels import compose as kc
from flashdora.kernels import configs, launcher, norm_gemm, norm_small, scales
from flashdora.kernels._common import HALF


def direct_plan(kernel, key: tuple, args: tuple, flags: dict) -> tuple | None:
    """The plan of the autotuned ``kernel`` that ``launcher.launch`` runs for a call with these arguments."""
    tuned = launcher._TUNED.get((id(kernel), key))
    if tuned is None or configs.INTERPRETED or type(kernel.fn) is Heuristics or not backend.private_apis():
        return None
    config, n_tensors = tuned
    return _plan((id(kernel), key), config, n_tensors, args, flags)


def jit_plan(kernel, args: tuple, flags: dict) -> tuple | None:
    """``direct_plan`` for a plain ``@triton.jit`` kernel that ``launcher.launch_jit`` has compiled (config ``{}``)."""
    n_tensors = launcher._JIT_TENSORS.get(id(kernel))
    if n_tensors is None or configs.INTERPRETED or not backend.private_apis():
        return None
    return _plan(launcher._jit_key(kernel, args, n_tensors), {}, n_tensors, args, flags)


def _plan(tuned_key: tuple, config: dict, n_tensors: int, args: tuple, flags: dict) -> tuple | None:
    spec = launcher._launch_specialization(args, n_tensors)
    hit = launcher._COMPILED.get((tuned_key, args[0].get_device(), tuple(flags.values()), (), spec))
    if hit is None or hit[0] is not None:
        return None
    _, _, function, warps, shared, types, _, keep = hit[:8]
    return config, function, warps, shared, types, list(range(len(args)) if keep is None else keep)


def compose_fwd(result, a, lora_B, scales_, scaling, bias, save_inner, lx_base=None) -> tuple | None:
    """``kernels.compose.compose_fwd_fused``'s launch for a call like this one: ``(CUfunction, warps, shared,
    BLOCK_M, BLOCK_N, types, kept)``. ``a`` may be a stand-in of the LoRA A output's dtype and width."""
    t, n, _, _, (key, args, flags) = kc._fused_call(result, a, lora_B, scales_, scaling, bias, lx_base, save_inner)
    plan = direct_plan(kc._compose_fused_fwd_kernel, key, args, flags) if t > 0 and n > 0 else None
    if plan is None:
        return None
    config, function, warps, shared, types, keep = plan
    return function, warps, shared, config["BLOCK_M"], config["BLOCK_N"], types, keep


_BWD: dict[tuple, tuple] = {}


def compose_bwd(t: int, n: int, dtype: torch.dtype, scales_: torch.Tensor, has_lx_base: bool = False) -> tuple | None:
    """``kernels.compose.compose_bwd``'s launch on ``t`` x ``n`` ``dtype`` gradients, as the C++ node calls it
    (``dy`` contiguous and aligned, ``inner`` and the outputs fresh): ``(CUfunction, warps, shared, BLOCK_N,
    n_split, rows_per_prog, types, kept)``."""
    key = (t, n, dtype, scales_.dtype, scales_.stride(0), scales_.data_ptr() & 15, scales_.device, has_lx_base)
    plan = _BWD.get(key)
    if plan is not None:
        return plan
    if t == 0 or n == 0:
        return None
    rows, like = kc._bwd_split(t, n, scales_)
    part = like.new_empty(1)  # an aligned stand-in for each tensor the node allocates or aligns
    args = (part, part, scales_, part, part, part, t, n, rows, 1.0, n, n, n, n, scales_.stride(0))
    flags = dict(HAS_INNER=True, HAS_LX_BASE=has_lx_base, EMULATE_RNE=configs.INTERPRETED)  # as compose_bwd's
    got = direct_plan(kc._compose_bwd_kernel, (n, dtype, dtype, scales_.dtype), args, flags)
    if got is None:
        return None
    config, function, warps, shared, types, keep = got
    plan = _BWD[key] = (function, warps, shared, config["BLOCK_N"], like.shape[0], rows, types, keep)
    return plan


def scales_kernel(lora_B, magnitude, n_part: int, d_out: int) -> tuple | None:
    """``kernels.scales.finish``'s scales kernel on ``n_part`` partial rows of ``d_out``: ``(CUfunction, warps,
    shared, types, kept)``."""
    f32 = lora_B.new_empty(1, dtype=torch.float32)  # stand-ins
    m = lora_B.new_empty(1, dtype=magnitude.dtype)
    got = jit_plan(scales._scales_kernel, (f32, m, f32, f32, n_part, d_out, d_out), scales._scales_flags(True))
    return None if got is None else tuple(got[1:])


def norm_gemm_miss(weight, lora_A, lora_B, magnitude) -> tuple | None:
    """``kernels.norm.norm_and_scales`` for a 16-bit ``weight`` in one chunk of ``norm_gemm`` (the C++ side makes the
    same launches in the same order): ``(transposed, BLOCK_J, epilogue's BLOCK_M, its launch, then the scales
    kernel's)``; ``None`` for other layers, and until a Python call has timed the cross term's layout."""
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    if weight.dtype not in HALF or d_out > norm_gemm._CHUNK_ELEMENTS // r:
        return None
    transposed = norm_gemm._TRANSPOSED.get((d_out, d_in, r, weight.dtype, weight.device))
    if transposed is None:
        return None
    block_j = configs.norm_block_r(r)
    f32 = lora_B.new_empty(1, dtype=torch.float32)  # stand-ins
    stride_cm, stride_cj = (1, d_out) if transposed else (r, 1)  # C = W a^T as [r, d_out] or [d_out, r]
    epilogue = direct_plan(
        norm_gemm._epilogue_kernel, (r, lora_B.dtype),
        (f32, lora_B, f32, f32, f32, d_out, r, 1.0, 1.0, stride_cm, stride_cj, lora_B.stride(0), lora_B.stride(1),
         d_out),
        dict(BLOCK_J=block_j),
    )  # fmt: skip
    finish = scales_kernel(lora_B, magnitude, triton.cdiv(r, block_j), d_out)
    if epilogue is None or finish is None:
        return None
    config, *epilogue_launch = epilogue
    return (transposed, block_j, config["BLOCK_M"], *epilogue_launch, *finish)


def norm_small_miss(weight, lora_A, lora_B, magnitude) -> tuple | None:
    """``kernels.norm_small.norm_and_scales`` for layers like this one: ``(BLOCK_M, splits, chunk, its launch)``,
    then the scales kernel's launch (zeros and empties for one split)."""
    d_out = weight.shape[0]
    n_split, chunk = norm_small.split(weight)
    f32 = lora_B.new_empty(1, dtype=torch.float32)  # stand-ins
    m = lora_B.new_empty(1, dtype=magnitude.dtype)
    out = f32.new_empty((3, d_out))
    args = norm_small._args(weight, lora_A, lora_B, f32, m, f32, out, f32, 1.0, chunk)
    flags = norm_small._flags(lora_A.shape[0], n_split > 1)
    plan = direct_plan(norm_small._small_kernel, norm_small._key(weight, lora_A, lora_B, m), args, flags)
    if plan is None:
        return None
    finish = (0, 0, 0, "", []) if n_split == 1 else scales_kernel(lora_B, magnitude, n_split, d_out)
    if finish is None:
        return None
    config, *launch = plan
    return (config["BLOCK_M"], n_split, chunk, *launch, *finish)
