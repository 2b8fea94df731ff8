"""Host time per launch of the compose kernels: ``configs.launch``'s direct path against Triton's own JIT dispatch.

Both run an already tuned and compiled kernel on the same arguments; the GPU work is a few microseconds, so the loop
measures what the host spends issuing one launch. Usage (GPU): PYTHONPATH=src python3 benchmarks/launch_cost.py
"""

import time

import torch

from flashdora.kernels import compose as kc
from flashdora.kernels import configs

t, n, r = 64, 4096, 384
dev = "cuda"
res = torch.randn(t, n, device=dev, dtype=torch.bfloat16)
a = torch.randn(t, r, device=dev, dtype=torch.bfloat16)
b = torch.randn(n, r, device=dev)
dy = torch.randn(t, n, device=dev, dtype=torch.bfloat16)
scales = torch.rand(3, n, device=dev)
g, gm1, inv = scales.unbind(0)


def per_call(fn, n_calls=3000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_calls):
        fn()
    host = (time.perf_counter() - t0) / n_calls * 1e6
    torch.cuda.synchronize()
    return host


def jit_path(kernel):
    """Patch ``configs.launch`` to dispatch through Triton's JIT with the tuned config (no direct launcher)."""

    def launch(kernel_, grid, key, args, flags):
        config = configs._TUNED.get((id(kernel_), key))
        if config is None:
            return configs_launch(kernel_, grid, key, args, flags)
        kernel_.fn[grid(config)](*args, **flags, **config)

    return launch


configs_launch = configs.launch
calls = {
    "compose_fwd_fused": lambda: kc.compose_fwd_fused(res, a, b, g, gm1, 1.0, save_inner=True),
    "compose_bwd": lambda: kc.compose_bwd(dy, res, scales, False),
}
for name, fn in calls.items():
    direct = per_call(fn)
    configs.launch = jit_path(None)
    kc.configs.launch = configs.launch
    jit = per_call(fn)
    configs.launch = kc.configs.launch = configs_launch
    direct2 = per_call(fn)
    print(f"{name:20s} host us per call: direct {direct:6.1f} / {direct2:6.1f}, Triton JIT dispatch {jit:6.1f}")
x = torch.zeros(128, device=dev)
print(f"{'torch add_':20s} host us per call: {per_call(lambda: x.add_(1)):6.1f}")
