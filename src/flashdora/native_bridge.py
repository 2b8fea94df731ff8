"""The bridge to the C++ extension (``native.py`` builds and adopts it; ``csrc/``): the only code that calls into it on
the layer path. On the ``native`` route (``dispatch``) a call runs in C++ once the extension holds the launch plans
of the Triton kernels the call needs; a call it has no plan for runs the Python Triton path, and the plans that path
compiled are filed, so the next call like it runs in C++. Callers never see the extension's own answers (a result,
``None`` for "not mine", ``False`` for "no plan yet").
"""

from __future__ import annotations

import torch

from flashdora import backend, config, native
from flashdora.ops import compose_fn
from flashdora.ops.compose_fn import _cast, _compute_dtype


def compose(result, lx, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base, seq, python):
    """The compose on the ``native`` route: the C++ forward (and, in training, its backward node), else
    ``python("native", ...)``, the Python Triton path (which may hang the C++ node on a Python-launched kernel:
    ``compose_with_node``), then the forward kernel's plan filed for the next call."""
    if native._at_quiet and not torch.is_grad_enabled():  # maybe a quiet point (``native.adopt_without_grad``)
        native.adopt_without_grad()
    y = native._adopted.forward(result, lx, lora_A, lora_B, magnitude, scales, bias, float(scaling), seq, lx_base)
    if y is not None and y is not False:
        backend.count("triton")
        if torch.is_grad_enabled():
            backend.count("native")
        return y
    out = python("native", result, lx, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base, seq)
    if y is False:
        _file_forward_plan(result, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base)
    return out


def _file_forward_plan(result, lora_A, lora_B, magnitude, scales, scaling, bias, lx_base=None) -> None:
    """Give ``flashdora.native``'s forward the launch plan of the forward kernel a call like this one runs (in
    training, saving ``inner``), once the Python path has compiled it (a shape's first calls tune, then compile). The
    backward kernel's plan is filed by ``compose_with_node`` at the first quiet point after that kernel compiled."""
    kc = compose_fn._kc or compose_fn._import_kernels()
    train = torch.is_grad_enabled() and magnitude.requires_grad
    device_type = result.device.type
    cd = _compute_dtype(device_type, lora_A, torch.is_autocast_enabled(device_type))
    n = result.shape[-1]
    # a stand-in for the LoRA A output: the plan depends on its dtype, width and alignment only
    a = result.new_empty((result.numel() // n, lora_A.shape[0]), dtype=cd)
    with torch.no_grad():
        b = lora_B if lora_B.numel() < compose_fn._CAST_B_FIRST else _cast(lora_B, cd)
    plan = kc.fwd_plan(result, a, b, scales, scaling, bias, train, lx_base)
    if plan is not None:
        native._adopted.register_forward(result, a, b, scales, bias, train, *plan, lx_base=lx_base)


def compose_with_node(result, a, bias, lora_B, scales, scaling, magnitude, cd, lx_base=None):
    """``ComposeFunction``'s Triton path with its backward as ``flashdora.native``'s C++ node (the route is
    ``native``: the extension is adopted, the bias rule holds), or ``None`` while the backward kernel is not compiled
    yet (the Python path's first backward compiles it) or its plan not yet filed (at the next quiet point)."""
    mod = native._adopted
    kc = compose_fn._kc or compose_fn._import_kernels()
    n = result.shape[-1]
    has_lx = lx_base is not None
    plan = kc.bwd_plan(result.numel() // n if n else 0, n, result.dtype, scales, has_lx)
    if plan is None:
        return None
    function = plan[0]
    if function not in _published:  # compiled in this step's backward: used from the next quiet point on
        if function not in _queued:
            _queued.add(function)
            native.when_quiet(lambda: _published.add(function))
        return None
    if id(plan) not in _filed:  # the C++ forward takes calls like this one from the next quiet point on
        _filed[id(plan)] = plan
        # (stand-ins of what the key reads: the result's shape, dtype and device, the scales' dtype and row stride)
        like = result.new_empty(1).expand(result.numel() // n, n)
        like_scales = scales.new_empty(1).as_strided((1, 1), (scales.stride(0), 1))
        native.when_quiet(lambda: mod.register_backward(like, like_scales, *plan, has_lx_base=has_lx))
    backend.count("triton")
    backend.count("native")
    b = lora_B if lora_B.numel() < compose_fn._CAST_B_FIRST else _cast(lora_B, cd)
    y, inner = kc.compose_fwd_fused(result, a, b, scales, scaling, bias, lx_base, save_inner=True)
    mod.attach(y, result, a, lora_B, magnitude, inner, scales, float(scaling), *plan, lx_base=lx_base)
    return y


_published: set[int] = set()  # backward kernels (their CUfunction) compiled before the last quiet point
_queued: set[int] = set()  # kernels compiled since, waiting for the next quiet point
_filed: dict[int, tuple] = {}  # the backward plans given to the extension (at a quiet point), by id (kept alive)


def norm_scales(weight, lora_A, lora_B, magnitude, scaling, w_sq, python):
    """A norm-cache miss on the ``native`` route: the C++ replay of the Triton norm's launches once planned, else
    ``python()`` (the Triton path), which compiles what the plan needs and is then filed. ``(norm, scales)``."""
    from flashdora.kernels import norm_small

    mod = native._adopted
    got = mod.norm_scales(weight, lora_A, lora_B, magnitude, w_sq, float(scaling), norm_small.MAX_R)
    if got is not None and got is not False:
        backend.count("norm:native")
        return got
    out = python()
    if got is False:  # no plan for layers like this one yet: the Python path has just compiled what it needs
        _file_norm_plan(mod, weight, lora_A, lora_B, magnitude)
    return out


def _file_norm_plan(mod, weight, lora_A, lora_B, magnitude) -> bool:
    """Files with the C++ extension how ``norm_and_scales`` launched for this layer (its small-rank kernel, with the
    scales kernel where it splits d_in, or ``norm_gemm``'s epilogue and the scales kernel), once the Python path has
    compiled them; whether it did."""
    from flashdora.kernels import norm_small
    from flashdora.kernels.norm import native_plan

    small = norm_small.takes(weight, lora_A)
    plan = (norm_small.native_plan if small else native_plan)(weight, lora_A, lora_B, magnitude)
    if plan is None:
        return False
    (mod.register_norm_small if small else mod.register_norm)(weight, lora_A, lora_B, magnitude, *plan)
    return True


def held_unchanged(held) -> bool | None:
    """``peft.mixed``'s kept-pack check in C++ (``csrc/check.cpp``) once the extension is adopted, else ``None`` (the
    caller runs its Python passes). ``held``: a ``peft.mixed._Held``."""
    mod = native._adopted
    if mod is None or not config.native_on:
        return None
    return mod.held_unchanged(held.tensors, held.owners, held.versions, held.ptrs, held.parents, held.modules,
                              held.types, held.dicts)  # fmt: skip
