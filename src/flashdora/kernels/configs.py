"""Autotune config lists and block-size heuristics for every flashdora kernel, in one place.

Under ``TRITON_INTERPRET=1`` each list is cut to one small config: the interpreter would otherwise "benchmark"
every config in Python, and one config skips the autotuner's timing altogether.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton import knobs
from triton.runtime.autotuner import Heuristics

from flashdora import backend

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _pick(gpu: list[triton.Config], interpreted: triton.Config) -> list[triton.Config]:
    return [interpreted] if INTERPRETED else gpu


def bench(kernel_call, quantiles):
    """Every autotuner's timer: Triton's ``do_bench`` over 25 ms per config instead of its default 100 ms. A fresh
    process spent 2.7 s of an 8B model's first step timing 21 configs (docs/history.md); our kernels
    take 0.02-0.5 ms, so 25 ms is still 50 or more calls per config."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


# Compose forward/backward: memory-bound tiles over [tokens, d_out]; key ["N"] (d_out), never the token count.
COMPOSE_FWD = _pick(
    [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 256}, num_warps=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 256}, num_warps=8),
        triton.Config({"BLOCK_M": 8, "BLOCK_N": 512}, num_warps=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=4),
    ],
    triton.Config({"BLOCK_M": 8, "BLOCK_N": 32}, num_warps=1),
)

# Every list below is short on purpose: a fresh machine compiles every config of every kernel in the first step
# (about 1 s a config on an H100), and the kernels here are a few percent of a step, so a config a little off the
# best costs less than the compile of one more (docs/design.md, "Cold start").
# Compose with the LoRA B matmul inside (K = r): GEMM tiles; key ["N", "R"].
COMPOSE_FUSED = _pick(
    [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=4, num_stages=3),
    ],
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}, num_warps=1, num_stages=1),
)

# The backward walks a fixed token range per program (set by the wrapper, so dg's summation order does not depend
# on the config) in steps of BLOCK_M.
COMPOSE_BWD = _pick(
    [
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=4),
        triton.Config({"BLOCK_M": 8, "BLOCK_N": 512}, num_warps=4),
    ],
    triton.Config({"BLOCK_M": 8, "BLOCK_N": 32}, num_warps=1),
)
# Tokens per backward program: a multiple of every BLOCK_M above; the split count aims at a few waves of programs.
COMPOSE_BWD_ROW_QUANTUM = 32
COMPOSE_BWD_TARGET_PROGRAMS_PER_SM = 16
COMPOSE_BWD_MIN_COL_BLOCK = 128  # the column block assumed when sizing the split (the smallest BLOCK_N above)

# Factored norm of float32 weights: a GEMM [d_out, d_in] x [d_in, r] with the row-dot against B in its epilogue.
# BLOCK_R (the r-slice per program) comes from norm_block_r, not the autotuner, so the partial-sum buffer's rows do
# not depend on the config; configs too big for shared memory at W's element size are shrunk by prune_norm.
NORM_FWD = _pick(
    [
        triton.Config({"BLOCK_M": 128, "BLOCK_K": 32}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_K": 32}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_K": 16}, num_warps=8, num_stages=4),
    ],
    triton.Config({"BLOCK_M": 16, "BLOCK_K": 16}, num_warps=1, num_stages=1),
)
# The epilogue of the 16-bit weights' norm (kernels/norm_gemm.py): a GEMM [rows, r] x [r, BLOCK_J] (B G on TF32)
# with the row-dot in its epilogue; key ["r"]. BLOCK_J is norm_block_r's (it sets the partial rows), not tuned.
NORM_EPILOGUE = _pick(
    [
        triton.Config({"BLOCK_M": 32, "BLOCK_G": 32}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_M": 64, "BLOCK_G": 32}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_G": 32}, num_warps=8, num_stages=3),
    ],
    triton.Config({"BLOCK_M": 16, "BLOCK_G": 16}, num_warps=1, num_stages=1),
)
NORM_GRAM_BLOCK_K = 32  # K step of the in-epilogue B_rows @ G[:, r-slice] product (K = r)
NORM_SMEM_BYTES = 200 * 1024  # operand ring budget (H100 allows 227 KiB per block; the epilogue needs some too)


def norm_block_r(r: int) -> int:
    """The r-slice per program: next_pow2(r) from 16 up to 128 (wider slices hold too many accumulators)."""
    return min(128, max(16, triton.next_power_of_2(r)))


def prune_norm(configs, named_args, **kwargs):
    """Drop configs whose W/A operand ring overflows shared memory; shrink the smallest if none fits."""
    esize = named_args["p_w"].element_size()
    block_r = kwargs.get("BLOCK_R", named_args.get("BLOCK_R"))

    def smem(c):
        return c.num_stages * (c.kwargs["BLOCK_M"] + block_r) * c.kwargs["BLOCK_K"] * esize

    kept = [c for c in configs if smem(c) <= NORM_SMEM_BYTES]
    if kept:
        return kept
    c = min(configs, key=smem)
    return [triton.Config({"BLOCK_M": c.kwargs["BLOCK_M"], "BLOCK_K": 32}, num_warps=c.num_warps, num_stages=2)]


def gram_blocks(r: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K) of the split-K ``A A^T`` kernel."""
    if INTERPRETED:
        return 16, 16
    return min(64, max(16, triton.next_power_of_2(r))), 64


def gram_splits(tiles: int, d_in: int, block_k: int, device) -> int:
    """Split-K factor for ``A A^T``: about two programs per SM, at least one K block per split."""
    if device.type != "cuda":
        return min(2, triton.cdiv(d_in, block_k))
    return max(1, min(triton.cdiv(d_in, block_k), triton.cdiv(2 * sm_count(device), tiles * tiles)))


def sm_count(device) -> int:
    """Multiprocessors of a CUDA ``device`` (2 elsewhere, for the interpreter's small grids); cached."""
    if device.type != "cuda":
        return 2
    return _sm_count(device.index if device.index is not None else _current_device())


@functools.cache
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()


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
        raise TypeError("configs.launch: tensor arguments must all come before the scalar ones")
    return n


def _check_complete(kernel, args: tuple, flags: dict) -> None:
    """Every parameter after ``args`` must come from ``flags``, the tuned config or a heuristic: the direct launch
    passes them by name and knows no signature defaults (checked on the first call of a key, on every machine)."""
    fn = kernel.fn
    given = {*flags, *kernel.configs[0].all_kwargs(), *getattr(fn, "values", {})}
    missing = [name for name in fn.arg_names[len(args) :] if name not in given]
    if missing:
        inner = fn
        while hasattr(inner, "fn"):
            inner = inner.fn
        name = getattr(inner, "__name__", type(inner).__name__)
        raise TypeError(f"configs.launch: {name} needs {missing} in flags (a direct launch knows no defaults)")


def autotune_enabled() -> bool:
    """``FLASHDORA_AUTOTUNE`` (default off): time every config of a kernel's list at each new key, instead of taking
    the list's first (its best on the H100 and H200 at the 8B shapes). Read at a key's first launch. Off, a fresh
    machine compiles one config per kernel in the first step rather than every config (docs/design.md, "Cold
    start"); ``kernel[grid]`` (untested versions) always tunes."""
    return backend.switch("FLASHDORA_AUTOTUNE", False)


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
    what inductor launches its own Triton kernels with: one C call), else through Triton's launcher. On the device
    machines' CPU the autotuner and JIT bookkeeping cost 30-80 us a launch and Triton's launcher 20-50 us more,
    which a DoRA layer of ordinary size cannot hide (docs/history.md).
    """
    if not backend.private_apis():  # untested torch or Triton: the plain launch (backend.TESTED)
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
    fn = kernel.fn
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


def direct_plan(kernel, key: tuple, args: tuple, flags: dict) -> tuple | None:
    """How to launch, from C++ (``flashdora.native``), the kernel ``launch`` runs for a call with these arguments:
    ``(tuned config, CUfunction, warps, shared bytes, parameter types, kept argument positions)``, or ``None`` until
    ``launch`` has tuned and compiled it, and where it runs through Triton's launcher instead of torch's."""
    tuned = _TUNED.get((id(kernel), key))
    if tuned is None or INTERPRETED or type(kernel.fn) is Heuristics or not backend.private_apis():
        return None
    config, n_tensors = tuned
    spec = _launch_specialization(args, n_tensors)
    hit = _COMPILED.get(((id(kernel), key), args[0].get_device(), tuple(flags.values()), (), spec))
    if hit is None or hit[0] is not None:
        return None
    _, _, function, warps, shared, types, _, keep = hit[:8]
    return config, function, warps, shared, types, list(range(len(args)) if keep is None else keep)


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
    on = backend.switch("FLASHDORA_STATIC_LAUNCH", True)
    return on and _raw_stream is not None and _static_launch_fn() is not None


@functools.cache
def _static_launch_fn():
    launcher = getattr(torch._C, "_StaticCudaLauncher", None)
    return None if launcher is None else getattr(launcher, "_launch_kernel", None)


def _static_launcher(fn, compiled, args: tuple):
    """``(None, launch, function, warps, shared, arg types, padding, keep)`` for torch's ``_StaticCudaLauncher``, or
    ``None`` where it cannot take this kernel (scratch memory, clusters, other signatures; ``launch`` checks the
    launch hooks on every call).

    The kernel's own loaded ``CUfunction`` is launched with the arguments its cubin takes: the positional ones
    Triton did not fold into constants (``keep``: their positions, ``None`` for all), plus one null pointer per
    scratch parameter newer Triton versions add (``padding``). Triton's launcher adds nothing else for a one-CTA,
    non-cooperative kernel without programmatic dependent launch."""
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
