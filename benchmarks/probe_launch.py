"""Host cost per call of the ways to launch flashdora's fused compose kernel, and torch's out_dtype matmuls (GPU).

The compose wrappers run twice: with ``configs.launch``'s direct path, and with Triton's own JIT dispatch of the
tuned config (sixth session: the direct path is 10-30 us cheaper per call, ``*_launch-cost-240afab.txt``, measured
with this comparison's first version, ``benchmarks/launch_cost.py`` at c0d02a3).

Usage: PYTHONPATH=src python3 benchmarks/probe_launch.py
"""

import time

import torch
import triton

from flashdora.kernels import compose as kc
from flashdora.kernels import configs

dev = torch.device("cuda")
t, n, r = 2048, 4096, 384
res = torch.randn(t, n, device=dev, dtype=torch.bfloat16)
a = torch.randn(t, r, device=dev, dtype=torch.bfloat16)
b = torch.randn(n, r, device=dev, dtype=torch.bfloat16)
g = torch.rand(n, device=dev) + 0.5
gm1 = g - 1


def host_us(fn, n_calls=500):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_calls):
        fn()
    us = (time.perf_counter() - t0) / n_calls * 1e6
    torch.cuda.synchronize()
    return us


y = torch.empty_like(res)
inner = torch.empty_like(res)
flags = dict(
    HAS_BIAS=False, HAS_LX_BASE=False, SAVE_INNER=True, EMULATE_RNE=False, DOT_PRECISION="tf32", UPCAST_DOT=False
)
grid = lambda meta: (triton.cdiv(t, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))
scales = torch.stack([g, gm1, 1 / g])
dy = torch.randn_like(res)
direct_launch = configs.launch


def jit_launch(kernel, grid_, key, args_, flags_):
    """Triton's JIT dispatch with the tuned config (what ``configs.launch`` replaces once a key is tuned)."""
    tuned = configs._TUNED.get((id(kernel), key))
    if tuned is None:
        return direct_launch(kernel, grid_, key, args_, flags_)
    config = tuned[0]
    kernel.fn[grid_(config)](*args_, **flags_, **config)


wrappers = {
    "compose_fwd_fused": lambda: kc.compose_fwd_fused(res, a, b, scales, 1.0, save_inner=True),
    "compose_bwd": lambda: kc.compose_bwd(dy, res, scales, False),
}
for name, fn in wrappers.items():
    direct = host_us(fn)
    configs.launch = jit_launch
    jit = host_us(fn)
    configs.launch = direct_launch
    print(f"wrapper {name}: direct launch {direct:.1f} us, Triton JIT dispatch {jit:.1f} us")
for label, f in (
    ("mm out_dtype fp32", lambda: torch.mm(a.T, a, out_dtype=torch.float32)),
    (
        "addmm out_dtype fp32",
        lambda: torch.addmm(
            torch.empty(0, device=dev, dtype=torch.float32), a.T, a, beta=0, alpha=0.5, out_dtype=torch.float32
        ),
    ),
    ("mm + to fp32", lambda: torch.mm(a.T, a).float()),
):
    try:
        out = f()
        print(f"{label}: {out.dtype} {out.shape}, host {host_us(f):.1f} us")
    except Exception as e:  # noqa: BLE001
        print(f"{label} failed: {type(e).__name__}: {str(e)[:200]}")

# The fused forward wrapper's pieces, each alone (what one layer call pays on this host, beside the kernel's launch).
kc.compose_fwd_fused(res, a, b, scales, 1.0, save_inner=True)  # tuned and compiled for these arguments
key = (n, r, res.dtype, a.dtype, b.dtype, res.dtype, g.dtype, g.dtype)
flags_f = dict(flags, SAVE_INNER=True, ROUND_BASE=False)
wa = b.T.contiguous()  # [r, n]
args_f = (res, a, b, res, scales, scales, y, inner, t, n, r, 1.0, n, r, r, n, n, n, n)
for label, f in (
    (
        "configs.launch alone (fused fwd)",
        lambda: configs.launch(kc._compose_fused_fwd_kernel, grid, key, args_f, flags_f),
    ),
    ("configs._specialization", lambda: configs._specialization(args_f)),
    ("configs._launch_specialization", lambda: configs._launch_specialization(args_f, 8)),
    ("torch.empty [t, n] bf16", lambda: torch.empty((t, n), dtype=torch.bfloat16, device=dev)),
    ("tensor.unbind(0) of [3, n]", lambda: scales.unbind(0)),
    ("F.linear [t, n] x [r, n]^T", lambda: torch.nn.functional.linear(res, wa)),
):
    print(f"{label}: host {host_us(f):.1f} us")
