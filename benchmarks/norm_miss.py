"""Host time of one layer's norm recomputation (a cache miss) on the Triton path, piece by piece.

``benchmarks/host_layer.py --step`` puts flashdora's norm lookup at about 200 us of host time per miss on the
device machines, against 10-25 us for a hit. This times the pieces of a miss on one PEFT DoRA layer, each in a loop
of ``--calls`` calls with the queue drained before and after (host time per call; the GPU is never the limit at
these sizes): the whole lookup after a version bump, the layer's CUDA-graph replay with and without its copy out, an
empty graph's replay, and the bookkeeping around them.

Usage: PYTHONPATH=src python3 benchmarks/norm_miss.py [--shape 4096x4096] [--rank 384] [--calls 200] [--turns 3]
"""

import argparse
import statistics
import time

import torch
from one_layer import peft_layer

import flashdora
from flashdora.ops import norm as norm_ops
from flashdora.ops import norm_group
from flashdora.peft_integration import _base_layer, _param

p = argparse.ArgumentParser()
p.add_argument("--shape", default="4096x4096", help="d_in x d_out")
p.add_argument("--rank", type=int, default=384)
p.add_argument("--calls", type=int, default=200)
p.add_argument("--turns", type=int, default=3)
args = p.parse_args()
dev = "cuda"
d_in, d_out = (int(v) for v in args.shape.split("x"))

model = flashdora.enable(peft_layer(d_in, d_out, args.rank, True, dev))
layer = model.base_model.model[0]
weight = _param(_base_layer(layer), "weight")
lora_A = layer.lora_A["default"].weight
lora_B = layer.lora_B["default"].weight
owner = layer.lora_magnitude_vector["default"]
magnitude = owner.weight
params = [lora_A, lora_B, magnitude]
x = torch.randn(16, d_in, device=dev, dtype=torch.bfloat16)
for _ in range(4):  # captures the layer's norm graph
    torch.autograd.graph.increment_version(params)
    with torch.autocast(dev, dtype=torch.bfloat16):
        model(x).float().sum().backward()
torch.cuda.synchronize()
cache = owner.__dict__["_flashdora_cache"]
graph = cache["graph"][1]
empty = torch.cuda.CUDAGraph()
with torch.cuda.graph(empty):
    pass
keys = norm_ops._tensor_keys(weight, lora_A, lora_B, magnitude)


def lookup_miss():
    torch.autograd.graph.increment_version(params)
    norm_ops.NormCache.lookup_owner(weight, lora_A, lora_B, magnitude, 1.0, owner)


def lookup_hit():
    norm_ops.NormCache.lookup_owner(weight, lora_A, lora_B, magnitude, 1.0, owner)


def bump():
    torch.autograd.graph.increment_version(params)


pieces = {
    "lookup, miss (version bumped)": lookup_miss,
    "version bump alone": bump,
    "lookup, hit": lookup_hit,
    "graph replay, held-check (NormGraph())": graph,
    "graph replay alone": graph.graph.replay,
    "empty graph replay": empty.replay,
    "out.clone()": graph.out.clone,
    "_tensor_keys": lambda: norm_ops._tensor_keys(weight, lora_A, lora_B, magnitude),
    "_storage": lambda: norm_ops._storage(keys, 1.0, cache["w_sq"]),
    "norm_group.recompute": lambda: norm_group.recompute(owner, weight),
    "torch.cuda.is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
}


def per_call_us(fn):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.calls):
        fn()
    us = (time.perf_counter() - t) / args.calls * 1e6
    torch.cuda.synchronize()
    return us


times = {}
for _ in range(args.turns):
    for name, fn in pieces.items():
        times.setdefault(name, []).append(per_call_us(fn))
print(f"# host us per call, {args.shape} r={args.rank}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
for name, got in times.items():
    print(f"{name:42s} median {statistics.median(got):8.1f} us (turns {min(got):.1f}-{max(got):.1f})")
print("paths:", dict(flashdora.stats()))

# Where a miss's host time goes, by CUDA runtime and aten call (torch.profiler, CPU side only).
with torch.profiler.profile(
    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
) as prof:
    for _ in range(20):
        lookup_miss()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))

# The same misses by Python function (cProfile: its own overhead inflates every entry alike).
import cProfile  # noqa: E402
import pstats  # noqa: E402

prof = cProfile.Profile()
prof.enable()
for _ in range(args.calls):
    lookup_miss()
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
