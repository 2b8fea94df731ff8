"""Host time of one layer's backward, apart from its forward: PEFT LoRA against flashdora, and a Python autograd
Function against the same math in C++ autograd (GPU host; 16 tokens, so the GPU never limits).

``benchmarks/host_layer.py`` puts flashdora's forward+backward of one 4096x4096 layer at 1.51x LoRA's host time on a
device machine (1337 against 885 us), while its inference is 0.84x and the CPU counts of ``host_calls.py`` find the
Python and aten work of a grad step level with LoRA's. This splits the two halves: ``backward`` is one
``y.backward(dy, retain_graph=True)`` on a graph built once. ``pyfunc`` / ``cfunc`` time a linear layer whose backward
is a Python ``torch.autograd.Function`` against ``F.linear``'s C++ node, to price what a Python backward costs on its
own (the autograd engine runs CUDA backward on its device thread, which must take the GIL for Python).

Usage: PYTHONPATH=src python3 benchmarks/host_backward.py [--shape 4096x4096] [--rank 384] [--turns 5]
"""

import argparse
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F
from one_layer import add_layer_arguments, peft_layer

import flashdora

p = argparse.ArgumentParser()
add_layer_arguments(p)
args = p.parse_args()
dev = "cuda" if torch.cuda.is_available() else "cpu"
d_in, d_out = (int(v) for v in args.shape.split("x"))


def layer(use_dora):
    return peft_layer(d_in, d_out, args.rank, use_dora, dev)


class PyLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy @ w, dy.t() @ x


x = torch.randn(args.tokens, d_in, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(args.tokens, d_out, device=dev, dtype=torch.bfloat16)
w = torch.randn(d_out, d_in, device=dev, dtype=torch.bfloat16, requires_grad=True)
models = {"peft_lora": layer(False), "flashdora": flashdora.enable(layer(True))}


def amp():
    return torch.autocast(dev, dtype=torch.bfloat16)


def forward(model):
    with amp():
        return model(x)


def calls():
    """name -> a no-argument call to time."""
    out = {}
    for name, model in models.items():
        out[f"{name} fwd_bwd"] = lambda model=model: forward(model).backward(dy)
        out[f"{name} forward (grad on)"] = lambda model=model: forward(model)
        y = forward(model)
        out[f"{name} backward"] = lambda y=y: y.backward(dy, retain_graph=True)
    out["cfunc fwd_bwd (F.linear)"] = lambda: F.linear(x, w).backward(dy)
    out["pyfunc fwd_bwd (Python Function)"] = lambda: PyLinear.apply(x, w).backward(dy)
    return out


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, n):
    for _ in range(20):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e6


fns = calls()
times = {name: [] for name in fns}
for _ in range(args.turns):
    for name, fn in fns.items():
        times[name].append(per_call_us(fn, args.calls))
device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
print(f"# command: PYTHONPATH=src python3 benchmarks/host_backward.py {' '.join(sys.argv[1:])}")
print(f"# host us per call, {args.shape} r={args.rank}, {args.tokens} tokens, {device}; "
      f"threads {[t.name for t in threading.enumerate()]}, switch interval {sys.getswitchinterval()}")  # fmt: skip
for name, got in times.items():
    print(f"{name:36s} median {statistics.median(got):8.1f} us (turns {min(got):.1f}-{max(got):.1f})")


# The same host work on the main thread and inside a backward (CUDA backward runs on the autograd engine's device
# thread): an empty Python call, torch.empty_like, and flashdora's compose backward on 16 tokens.
def work_items():
    from flashdora.kernels import compose as kc

    inner = torch.randn_like(dy)
    scales = torch.rand(3, d_out, device=dev)
    return {
        "empty Python call x100": lambda: [None for _ in range(100)] and None,
        "torch.empty_like": lambda: torch.empty_like(dy),
        "kernels.compose.compose_bwd": lambda: kc.compose_bwd(dy, inner, scales, False),
    }


class Probe(torch.autograd.Function):
    fn = None
    us = []

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        Probe.us.append(per_call_us(Probe.fn, args.calls))
        return g


if dev == "cuda":
    for name, fn in work_items().items():
        main = [per_call_us(fn, args.calls) for _ in range(args.turns)]
        Probe.fn, Probe.us = fn, []
        for _ in range(args.turns):
            Probe.apply(x).sum().backward()
        inside = statistics.median(Probe.us)
        print(f"{name:36s} main thread {statistics.median(main):7.2f} us, in a backward {inside:7.2f} us")
