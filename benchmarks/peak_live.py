"""Which tensors are alive at a layer step's memory peak: PEFT LoRA against flashdora (GPU).

``bench layer`` finds flashdora's fwd_bwd peak above LoRA's in pure bf16 at every shape (+16 MiB at 4096x4096, r =
384, 2048 tokens: one ``[tokens, d_in]`` bf16 tensor) while it is below LoRA's under autocast. This names the
tensors: one ``bench layer`` step per mode (``bench.layer.step_fn``, weights marked changed) under torch's memory
history, the allocator's events replayed to the point where the step's own allocations peak, and the blocks alive
there listed with the Python line that allocated them (largest first).

Usage: PYTHONPATH=src python3 benchmarks/peak_live.py [--shape 4096x4096] [--rank 384] [--tokens 2048]
[--dtype bf16|autocast] [--top 12]
"""

import argparse

import torch

from flashdora.bench.layer import build_layers, step_fn
from one_layer import add_step_arguments, step_inputs

p = argparse.ArgumentParser()
add_step_arguments(p)
p.add_argument("--dtype", default="bf16", choices=("bf16", "autocast"))
p.add_argument("--top", type=int, default=12)
args = p.parse_args()
MIB = 2**20


def where(frames) -> str:
    """The innermost frames outside torch's own files, as ``file:line name`` (up to three)."""
    mine = [f for f in frames if "/torch/" not in f["filename"] or "/peft/" in f["filename"]]
    return " < ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in mine[:3]) or "?"


def live_at_peak(trace) -> tuple[int, list]:
    """(peak bytes allocated during the step, [(size, frames)] alive at that point)."""
    live, now, peak, at_peak = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            now += e["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    return peak, sorted(at_peak.values(), key=lambda v: -v[0])


weight, x, dy = step_inputs(args)
layers = build_layers(weight, args.rank, args.dtype, ["peft_lora", "flashdora"])
print(f"# {args.shape} r={args.rank} {args.tokens} tokens {args.dtype}: blocks alive at the step's own peak")
for mode, (_, layer) in layers.items():
    step = step_fn(layer, x, dy, "fwd_bwd", args.dtype == "autocast")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, blocks = live_at_peak(snap["device_traces"][torch.cuda.current_device()])
    print(f"\n## {mode}: peak {peak / MIB:.2f} MiB above the step's start "
          f"(max_memory_allocated - start: {(torch.cuda.max_memory_allocated() - base) / MIB:.2f})")  # fmt: skip
    for size, frames in blocks[: args.top]:
        print(f"  {size / MIB:8.2f} MiB  {where(frames)}")
