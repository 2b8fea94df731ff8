"""Host against GPU time of one layer's forward+backward, as ``flashdora bench layer`` times it (GPU).

``bench layer``'s ``fwd_bwd`` row at 4096x4096 (r = 384, 2048 tokens, autocast) is short of its bars by a few
percent and moves 20% or more from run to run. This says which clock sets it, per mode (PEFT LoRA, PEFT DoRA,
flashdora), on the bench's own step (``bench.layer.step_fn``: weights marked changed, forward under autocast,
backward, gradients dropped):

- ``loop``: the bench's number, the median of back-to-back calls timed by CUDA events;
- ``host``: the time Python takes to issue one call with the queue empty at its start, and ``wall`` its event time;
- ``gpu``: the sum of the call's kernel times (torch.profiler), the floor if the host were free;
- ``forward``, ``backward``, ``drop``: each mode's host time in the loop for ``layer(x)``, ``y.backward(dy)`` and
  dropping the gradients and the output (the queue is not drained between calls, as in the bench);
- flashdora's host-side CUDA runtime and driver calls in the loop, under torch.profiler (a ranking);
- for flashdora, where the host time of the norm's recomputation goes, each piece timed inclusively in the loop.

Usage: PYTHONPATH=src:benchmarks python3 benchmarks/fwd_bwd_split.py [--shape 4096x4096] [--rank 384]
[--tokens 2048] [--calls 200] [--turns 3]
"""

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import flashdora
from flashdora.bench import timing
from flashdora.bench.layer import build_layer, step_fn
from flashdora.kernels import norm as kn
from flashdora.ops import norm as norm_ops
from flashdora.ops import norm_group
from one_layer import add_step_arguments, step_inputs

p = argparse.ArgumentParser()
add_step_arguments(p)
p.add_argument("--calls", type=int, default=200)
p.add_argument("--turns", type=int, default=3)
args = p.parse_args()
dev = "cuda"
weight, x, dy = step_inputs(args, dev)
steps, layers = {}, {}
for name, dora in (("peft_lora", False), ("peft_dora", True), ("flashdora", True)):
    torch.manual_seed(1)
    model, layer = build_layer(weight, args.rank, dora, "autocast")
    if name == "flashdora":
        flashdora.enable(model)
    steps[name] = step_fn(layer, x, dy, "fwd_bwd", autocast=True)
    layers[name] = layer


def gpu_us(step, n=10) -> float:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / n


rows = defaultdict(lambda: defaultdict(list))
for _ in range(args.turns):
    for name, step in steps.items():
        m = timing.measure(step, warmup=10, reps=args.calls, device=dev)
        host, wall = timing.host_and_wall(step, 50, dev)
        for key, v in (("loop", m.ms * 1e3), ("host", host * 1e3), ("wall", wall * 1e3), ("gpu", gpu_us(step))):
            rows[name][key].append(v)

print(f"# us per fwd_bwd call, {args.shape} r={args.rank}, {args.tokens} tokens, autocast, weights marked changed")
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; median of {args.turns} turns (spread)")
for name, cols in rows.items():
    cells = [f"{k} {statistics.median(v):7.1f} ({min(v):.0f}-{max(v):.0f})" for k, v in cols.items()]
    print(f"{name:10s} " + "  ".join(cells))


def parts_us(layer) -> dict:
    """Host us per call of the bench step's three parts, in a loop of ``args.calls`` calls."""
    params = [q for q in layer.parameters() if q.requires_grad]
    spent = defaultdict(float)
    for i in range(10 + args.calls):
        if i == 10:
            torch.cuda.synchronize()
            spent.clear()
        torch.autograd.graph.increment_version(params)
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        t1 = time.perf_counter()
        y.backward(dy)
        t2 = time.perf_counter()
        x.grad = None
        for q in params:
            q.grad = None
        del y
        t3 = time.perf_counter()
        spent["forward"] += t1 - t0
        spent["backward"] += t2 - t1
        spent["drop"] += t3 - t2
    torch.cuda.synchronize()
    return {k: v / args.calls * 1e6 for k, v in spent.items()}


print("\n# host us per call by part, in the loop (median of turns)")
parts = defaultdict(lambda: defaultdict(list))
for _ in range(args.turns):
    for name, layer in layers.items():
        for k, v in parts_us(layer).items():
            parts[name][k].append(v)
for name, cols in parts.items():
    print(f"{name:10s} " + "  ".join(f"{k} {statistics.median(v):7.1f}" for k, v in cols.items()))

# The host's CUDA calls inside flashdora's loop (torch.profiler; slower than the plain loop: read as a ranking).
step = steps["flashdora"]
for _ in range(10):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        step()
    torch.cuda.synchronize()
print("\n# flashdora loop under torch.profiler, 20 calls: host-side CUDA runtime and driver calls")
events = [e for e in prof.key_averages() if e.key.startswith(("cuda", "cu"))]
for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]:
    print(f"{e.key:40s} calls {e.count // 20:3d}/call  self cpu {e.self_cpu_time_total / 20:7.1f} us/call")

# Where flashdora's norm recomputation spends host time inside the loop: inclusive timers on its pieces.
spent = defaultdict(float)


def timed(label, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[label] += time.perf_counter() - t

    return wrapper


graph_replay = torch.cuda.CUDAGraph.replay
torch.cuda.CUDAGraph.replay = timed("   CUDAGraph.replay", graph_replay)


NC = norm_ops.NormCache
NC.lookup_owner = classmethod(timed("lookup_owner", NC.__dict__["lookup_owner"].__func__))
NC._update = staticmethod(timed(" _update", NC.__dict__["_update"].__func__))
NC._weight_sq = staticmethod(timed("  _weight_sq", NC.__dict__["_weight_sq"].__func__))
norm_ops._tensor_keys = timed(" _tensor_keys", norm_ops._tensor_keys)
norm_ops._storage = timed("  _storage", norm_ops._storage)
norm_ops._fresh_graphed = timed("  _fresh_graphed", norm_ops._fresh_graphed)
norm_group.recompute = timed("  norm_group.recompute", norm_group.recompute)
norm_group.note = timed("  norm_group.note", norm_group.note)
kn.NormGraph.__call__ = timed("  NormGraph()", kn.NormGraph.__call__)
step = steps["flashdora"]
for _ in range(10):
    step()
torch.cuda.synchronize()
spent.clear()
before = dict(flashdora.stats())
t = time.perf_counter()
for _ in range(args.calls):
    step()
torch.cuda.synchronize()
total = (time.perf_counter() - t) / args.calls * 1e6
print(f"\n# flashdora loop with timers: {total:.1f} us per call; inclusive host us per call")
for label, s in spent.items():
    print(f"{label:28s} {s / args.calls * 1e6:7.1f}")
paths = {k: v - before.get(k, 0) for k, v in flashdora.stats().items() if v != before.get(k, 0)}
print("paths in the timed loop:", paths)
torch.cuda.CUDAGraph.replay = graph_replay

# Where flashdora's forward spends host time inside the loop: inclusive timers on the PEFT seam's pieces.
from flashdora import peft_integration as pi  # noqa: E402
from flashdora.ops import compose as ops_compose  # noqa: E402


class _TimedNative:
    """The C++ extension with its forward timed."""

    def __init__(self, ext):
        self.ext, self.forward = ext, timed("    native.forward", ext.forward)

    def __getattr__(self, name):
        return getattr(self.ext, name)


spent.clear()
saved = (pi._lean_forward, pi.flash_forward, pi.compose_eager, ops_compose._native)
layer = layers["flashdora"]
layer.base_layer.forward = timed(" base_layer.forward", layer.base_layer.forward)
pi._lean_forward = timed("_lean_forward", pi._lean_forward)
pi.flash_forward = timed(" flash_forward", pi.flash_forward)
pi.compose_eager = timed("   compose_eager", pi.compose_eager)
if ops_compose._native:  # (None or False: the C++ forward is off or not built, and the Python path runs)
    ops_compose._native = _TimedNative(ops_compose._native)
for i in range(10 + args.calls):
    if i == 10:
        torch.cuda.synchronize()
        spent.clear()
    step()
torch.cuda.synchronize()
print("\n# flashdora forward pieces in the loop (the norm's timers still on), inclusive host us per call")
for label, s in spent.items():
    print(f"{label:28s} {s / args.calls * 1e6:7.1f}")
pi._lean_forward, pi.flash_forward, pi.compose_eager, ops_compose._native = saved
del layer.base_layer.forward
