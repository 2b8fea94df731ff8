"""Host time of each autograd node and aten op in one layer's forward+backward: PEFT LoRA against flashdora (GPU).

``fwd_bwd_split.py`` puts flashdora's host time in ``bench layer``'s fwd_bwd step above LoRA's in the backward (425
against 348 us at 4096x4096, r = 384, 2048 tokens, autocast). This names where: the bench's own step
(``bench.layer.step_fn``, weights marked changed each call) under torch.profiler, per mode:

- each autograd node the engine ran (``autograd::engine::evaluate_function: ...``): calls and inclusive host us per
  step;
- the ops with the most self host time per step (aten ops, CUDA runtime and driver calls, Python-side records).

The profiler adds a few us to every op it records: read the columns as a ranking and the differences between modes,
not as the unprofiled step's microseconds.

Usage: PYTHONPATH=src python3 benchmarks/backward_nodes.py [--shape 4096x4096] [--rank 384] [--tokens 2048]
[--steps 50] [--top 25]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import flashdora
from flashdora.bench.layer import build_layer, step_fn
from one_layer import add_step_arguments, step_inputs

p = argparse.ArgumentParser()
add_step_arguments(p)
p.add_argument("--steps", type=int, default=50)
p.add_argument("--top", type=int, default=25)
args = p.parse_args()
weight, x, dy = step_inputs(args)
NODE = "autograd::engine::evaluate_function: "

for name, dora in (("peft_lora", False), ("flashdora", True)):
    torch.manual_seed(1)
    model, layer = build_layer(weight, args.rank, dora, "autocast")
    if dora:
        flashdora.enable(model)
    step = step_fn(layer, x, dy, "fwd_bwd", autocast=True)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    n = args.steps
    print(f"\n## {name}: autograd nodes (calls per step, inclusive host us per step)")
    for e in sorted((e for e in events if e.key.startswith(NODE)), key=lambda e: -e.cpu_time_total):
        print(f"  {e.key[len(NODE):]:44s} {e.count / n:4.1f}  {e.cpu_time_total / n:8.1f}")
    total = sum(e.self_cpu_time_total for e in events) / n
    print(f"## {name}: top ops by self host us per step (all recorded ops: {total:.1f} us per step)")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        print(f"  {e.key[:60]:60s} {e.count / n:5.1f}  self {e.self_cpu_time_total / n:7.1f}  "
              f"incl {e.cpu_time_total / n:7.1f}")  # fmt: skip
    del model, layer, step
