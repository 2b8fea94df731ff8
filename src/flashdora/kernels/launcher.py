"""How flashdora launches its autotuned Triton kernels: ``launch`` (one config per kernel by default, or Triton's
autotuner under ``FLASHDORA_AUTOTUNE=1``), then the compiled kernel straight through torch's C++ launcher on later
calls (``native.plans`` reads the compiled kernels from here for the C++ side). The config lists live in
``configs``."""

from __future__ import annotations

import functools

import torch
import triton
from triton import knobs
from triton.runtime.autotuner import Heuristics

from flashdora import backend, config
from flashdora.kernels.configs import INTERPRETED

_TUNED: dict[tuple, tuple] = {}  # (kernel, key) -> (the autotuner's choice, how many leading tensor arguments)
_COMPILED: dict[tuple, tuple] = {}  # (kernel, key, flags, specialization) -> (compiled kernel, its launcher, tail)
_I32_MIN, _I32_MAX = -(2**31), 2**31


def _specialization(args: tuple) -> tuple:
    """What Triton specializes a compiled kernel on, per argument, as a small int: 16-byte alignment of pointers;
    divisibility by 16, equality to 1 and 32-bit range of integers. Two calls with equal tuples can share one
    compiled kernel. (One loop with int codes; a generator was slower.)"""
    codes = []
    for a in args:
        kind = type(a)
        if kind is int:
            codes.append((not a & 15) + 2 * (a == 1) + 4 * (_I32_MIN <= a < _I32_MAX))
        elif kind is float:
            codes.append(8)
        else:  # a tensor
            codes.append(16 + (not a.data_ptr() & 15))
    return tuple(codes)


_TAIL_CODES: dict[tuple, tuple] = {}  # the scalar arguments of a launch -> their ``_specialization``
_TAIL_CODES_MAX = 4096  # distinct scalar tuples kept (token counts vary with batches); then it starts over


def _launch_specialization(args: tuple, n_tensors: int) -> tuple:
    """``_specialization(args)`` for arguments whose first ``n_tensors`` are the tensors, at the host cost of one
    pass over the pointers and a dict lookup: this runs on every launch. All pointers 16-byte aligned (the caching
    allocator's blocks are) give one code for the lot; the scalars' codes are looked up by their values."""
    bits = 0
    for a in args[:n_tensors]:
        bits |= a.data_ptr()
    head = n_tensors if not bits & 15 else _specialization(args[:n_tensors])
    tail = args[n_tensors:]
    codes = _TAIL_CODES.get(tail)
    if codes is None:
        if len(_TAIL_CODES) >= _TAIL_CODES_MAX:
            _TAIL_CODES.clear()
        codes = _TAIL_CODES[tail] = _specialization(tail)
    return head, codes


def _leading_tensors(args: tuple) -> int:
    """How many of ``args`` come before the first non-tensor (all of them are tensors there: checked)."""
    n = 0
    while n < len(args) and isinstance(args[n], torch.Tensor):
        n += 1
    if any(isinstance(a, torch.Tensor) for a in args[n:]):
        raise TypeError("launcher.launch: tensor arguments must all come before the scalar ones")
    return n


def _check_complete(kernel, args: tuple, flags: dict) -> None:
    """Every parameter after ``args`` must come from ``flags``, the tuned config or a heuristic: the direct launch
    passes them by name and knows no signature defaults (checked on the first call of a key, on every machine).
    ``kernel``: an autotuned kernel, or a plain ``@triton.jit`` one (``launch_jit``)."""
    configs = getattr(kernel, "configs", None)
    fn = kernel.fn if configs else kernel
    tuned = configs[0].all_kwargs() if configs else {}
    given = {*flags, *tuned, *getattr(fn, "values", {})}
    missing = [name for name in fn.arg_names[len(args) :] if name not in given]
    if missing:
        inner = fn
        while hasattr(inner, "fn"):
            inner = inner.fn
        name = getattr(inner, "__name__", type(inner).__name__)
        raise TypeError(f"launcher.launch: {name} needs {missing} in flags (a direct launch knows no defaults)")


def autotune_enabled() -> bool:
    """``FLASHDORA_AUTOTUNE`` (default off): time every config of a kernel's list at each new key, instead of taking
    the list's first, its best at the shapes measured (docs/host-notes.md). Read at a key's first
    launch. Off, a fresh machine compiles one config per kernel in the first step rather than every config
    (docs/design.md, "Cold start"); ``kernel[grid]`` (untested versions) always tunes."""
    return config.autotune


def default_config(kernel, args: tuple, flags: dict) -> triton.Config:
    """The first of ``kernel``'s configs that its own pruning keeps for these arguments (``prune_configs_by``)."""
    candidates = kernel.configs
    prune = getattr(kernel, "early_config_prune", None)
    if prune is not None:
        candidates = prune(candidates, dict(zip(kernel.arg_names, args)), **flags)
    return candidates[0]


def launch(kernel, grid, key: tuple, args: tuple, flags: dict) -> None:
    """``kernel[grid](*args, **flags)`` for an autotuned ``kernel``, at a fraction of the host cost once warm.

    ``key`` must determine the autotuner's choice (its key values and the argument dtypes); ``flags`` are the
    constexpr keyword arguments. The first call of a key takes the list's first config (``default_config``), or
    runs the autotuner under ``FLASHDORA_AUTOTUNE=1``; the first call of each
    (key, device, flags, specialization) compiles through Triton's JIT; later calls launch the compiled kernel
    directly: through torch's C++ launcher of compiled Triton kernels where torch has one (``_StaticCudaLauncher``,
    what inductor launches its own Triton kernels with: one C call), else through Triton's launcher. The autotuner's
    and JIT's per-launch bookkeeping is host time a DoRA layer of ordinary size cannot hide (docs/host-notes.md).
    """
    if not backend.private_apis():  # untested torch or Triton: the plain launch (config.TESTED)
        kernel[grid](*args, **flags)
        return
    tuned_key = (id(kernel), key)
    tuned = _TUNED.get(tuned_key)
    if tuned is None:
        _check_complete(kernel, args, flags)
        n_tensors = _leading_tensors(args)
        if not autotune_enabled():
            tuned = _TUNED[tuned_key] = (default_config(kernel, args, flags).all_kwargs(), n_tensors)
        else:
            kernel[grid](*args, **flags)
            if INTERPRETED:
                return
            _TUNED[tuned_key] = (kernel.best_config.all_kwargs(), n_tensors)
            return
    config, n_tensors = tuned
    g = grid(config)
    if INTERPRETED:
        kernel.fn[g](*args, **flags, **config)
        return
    _run(kernel.fn, g, tuned_key, args, flags, config, n_tensors)


def launch_jit(kernel, grid: tuple, args: tuple, flags: dict) -> None:
    """``kernel[grid](*args, **flags)`` for a plain ``@triton.jit`` kernel (nothing to tune), as ``launch`` runs an
    autotuned one: compiled through Triton's JIT at the first call of each (argument dtypes, device, flags,
    specialization), then launched directly. The tensors' dtypes are part of the key here (Triton compiles a kernel
    per pointer dtype), so a caller has nothing to get wrong."""
    if not backend.private_apis():
        kernel[grid](*args, **flags)
        return
    checked = (id(kernel), *flags)
    n_tensors = _JIT_TENSORS.get(checked)
    if n_tensors is None:
        _check_complete(kernel, args, flags)
        n_tensors = _JIT_TENSORS[checked] = _JIT_TENSORS[id(kernel)] = _leading_tensors(args)
    if INTERPRETED:
        kernel[grid](*args, **flags)
        return
    _run(kernel, grid, _jit_key(kernel, args, n_tensors), args, flags, {}, n_tensors)


# (id(kernel), flag names) checked complete -> how many leading tensor arguments the kernel takes; also by id(kernel)
_JIT_TENSORS: dict = {}


def _jit_key(kernel, args: tuple, n_tensors: int) -> tuple:
    return id(kernel), tuple(a.dtype for a in args[:n_tensors])


def _run(fn, g: tuple, tuned_key: tuple, args: tuple, flags: dict, config: dict, n_tensors: int) -> None:
    """Launch ``fn`` (a ``JITFunction`` or ``Heuristics``) with ``config``: compiled through Triton's JIT at the first
    call of each (key, device, flags, specialization), directly after that."""
    extra = ()
    if type(fn) is Heuristics:  # constexprs computed from the arguments (e.g. EVEN_K)
        named = {**dict(zip(fn.arg_names, args)), **flags, **config}
        extra = tuple(rule(named) for rule in fn.values.values())
    device = args[0].get_device()
    compiled_key = (tuned_key, device, tuple(flags.values()), extra, _launch_specialization(args, n_tensors))
    hit = _COMPILED.get(compiled_key)
    if hit is None:
        compiled = fn[g](*args, **flags, **config)
        if getattr(compiled, "run", None) is not None and hasattr(compiled, "packed_metadata"):  # a CompiledKernel
            constexprs = {**flags, **config, **dict(zip(fn.values, extra))} if extra else {**flags, **config}
            _COMPILED[compiled_key] = _launcher(fn, compiled, args, constexprs)
        return
    stream = _raw_stream(device)
    hooks = knobs.runtime
    enter, leave = _hook(hooks.launch_enter_hook), _hook(hooks.launch_exit_hook)  # profilers (e.g. proton) set these
    if hit[0] is None and enter is None and leave is None:  # torch's C++ launcher
        _, run, function, warps, shared, types, pad, keep = hit[:8]
        run(
            function, g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, warps, shared, types,
            (args if keep is None else tuple(args[i] for i in keep)) + pad, stream,
        )  # fmt: skip
        return
    compiled, run, function, packed, tail = hit[-5:]
    metadata = None if enter is None else compiled.launch_metadata(g, stream, *args, *tail)
    run(
        g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, stream, function, packed, metadata,
        enter, leave, *args, *tail,
    )  # fmt: skip


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_HookChain = getattr(knobs, "HookChain", None)


def _hook(hook):
    """A launch hook as Triton's launcher takes it, ``None`` for an empty chain (Triton >= 3.5 keeps an empty
    ``HookChain`` there: calling it, and building the launch metadata it would get, is host time for nothing)."""
    if hook is not None and _HookChain is not None and type(hook) is _HookChain and not hook.calls:
        return None
    return hook


_TORCH_TYPES = {
    "i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H", "u32": "I",
    "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d",
}  # fmt: skip


def _launcher(fn, compiled, args: tuple, constexprs: dict) -> tuple:
    """How ``launch`` runs a compiled kernel from now on: Triton's launcher, ``(compiled, run, function, packed
    metadata, constexpr tail)``, after torch's C++ launcher's 8 fields where torch's can take the kernel."""
    tail = tuple(constexprs[name] for name in fn.arg_names[len(args) :])
    triton_launch = (compiled, compiled.run, compiled.function, compiled.packed_metadata, tail)
    static = _static_launcher(fn, compiled, args) if _static_ok() else None
    return triton_launch if static is None else static + triton_launch  # Triton's, for when a hook is set later


def _static_ok() -> bool:
    """torch's launcher is there and not switched off (``FLASHDORA_STATIC_LAUNCH=0``: Triton's launcher always)."""
    return config.static_launch and _raw_stream is not None and _static_launch_fn() is not None


@functools.cache
def _static_launch_fn():
    launcher = getattr(torch._C, "_StaticCudaLauncher", None)
    return None if launcher is None else getattr(launcher, "_launch_kernel", None)


def _static_launcher(fn, compiled, args: tuple):
    """``(None, launch, function, warps, shared, arg types, padding, keep)`` for torch's ``_StaticCudaLauncher``, or
    ``None`` where it cannot take this kernel (scratch memory, clusters, other signatures). ``keep``: positions of the
    arguments Triton did not fold into constants; ``padding``: null pointers for newer Triton's scratch parameters."""
    try:
        meta = compiled.metadata
        if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False):
            return None
        if getattr(meta, "launch_pdl", False) or getattr(meta, "tensordesc_meta", None):
            return None
        pad = ()
        for name in ("global_scratch_size", "profile_scratch_size"):
            if hasattr(meta, name):
                if getattr(meta, name) > 0:
                    return None
                pad += (None,)
        src = compiled.src
        names = list(fn.arg_names)

        def index(k):
            if isinstance(k, str):
                return names.index(k)
            return k[0] if isinstance(k, tuple) else k

        signature = {index(k): v for k, v in src.signature.items()}
        constants = {index(k) for k in getattr(src, "constants", {})}
        keep, types = [], []
        for i in sorted(signature):
            ty = signature[i]
            if ty == "constexpr" or i in constants:
                continue
            if i >= len(args):  # a runtime parameter among the constexpr flags: not what our kernels have
                return None
            keep.append(i)
            types.append("O" if ty.startswith("*") else _TORCH_TYPES[ty])
        compiled._init_handles()
        function = compiled.function
        if function is None:
            return None
        keep = None if keep == list(range(len(args))) else tuple(keep)
        shared = getattr(compiled, "shared", None)
        shared = meta.shared if shared is None else shared
        types = "".join(types) + "O" * len(pad)
        return (None, _static_launch_fn(), function, meta.num_warps, shared, types, pad, keep)
    except Exception:  # noqa: BLE001 - an unknown Triton or torch layout: Triton's own launcher still works
        return None
