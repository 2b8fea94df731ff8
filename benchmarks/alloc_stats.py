"""What the CUDA caching allocator does in each timed step, PEFT LoRA against flashdora (GPU).

With gradient accumulation 4 and PyTorch's default allocator, llama3-8b's flashdora step ran 1.35x LoRA's, and
0.99x with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (docs/decisions.md, eighth session). This prints, per
step and mode, the step's time and the allocator counters that move during it: device allocations and frees
(``cudaMalloc``/``cudaFree``; a free waits for the device), allocation retries (the allocator freeing its cache to
satisfy a request), segments and reserved memory. ``flashdora_nograph`` is flashdora with ``FLASHDORA_NORM_GRAPH=0``
(no per-layer norm CUDA graphs, whose captures draw on a memory pool of their own).

Usage: PYTHONPATH=src python3 benchmarks/alloc_stats.py [--preset llama3-8b] [--grad-accum 4] [--steps 6]
  [--layers N] [--runs peft_lora flashdora flashdora_nograph]
"""

import argparse
import os
import sys
import time

import torch

import flashdora
from flashdora.bench import model as bm
from flashdora.bench import timing

COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams", "num_ooms")
GAUGES = ("segment.all.current", "reserved_bytes.all.current", "inactive_split.all.current")

p = argparse.ArgumentParser()
bm.add_arguments(p)
p.set_defaults(grad_accum=4, phases=["grad"])
p.add_argument("--steps", type=int, default=6, help="steps printed per mode (after --warmup)")
RUNS = ["peft_lora", "flashdora", "flashdora_nograph"]
p.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS, help="what to run (instead of --modes)")
args = p.parse_args()
device = torch.device("cuda")
print(
    f"# command: PYTHONPATH=src python3 benchmarks/alloc_stats.py {' '.join(sys.argv[1:])} "
    f"(PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'default')}, "
    f"{torch.cuda.get_device_name()})"
)
name, config = bm.build_config(args)
torch.manual_seed(args.seed)
ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
base = bm.build_base(config, args, device)


def report(mode, step):
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    for k in range(args.steps):
        before = torch.cuda.memory_stats()
        t = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t) * 1e3
        after = torch.cuda.memory_stats()
        moved = {c: after.get(c, 0) - before.get(c, 0) for c in COUNTERS}
        segments, reserved, splits = (after.get(g, 0) for g in GAUGES)
        print(
            f"{mode:18s} step {k}: wall {wall_ms:8.1f} ms, host {host_ms:8.1f} ms | "
            + ", ".join(f"{c} {v:+d}" for c, v in moved.items())
            + f" | segments {segments}, reserved {reserved / 2**30:.2f} GiB, inactive splits {splits}"
        )


for use_dora, modes in ((False, ["peft_lora"]), (True, ["flashdora", "flashdora_nograph"])):
    modes = [m for m in modes if m in args.runs]
    if not modes:
        continue
    peft_model = bm.wrap(base, args, use_dora)
    for mode in modes:
        if use_dora:
            flashdora.enable(peft_model)  # (again for each mode: a fresh norm cache)
        os.environ["FLASHDORA_NORM_GRAPH"] = "0" if mode == "flashdora_nograph" else "1"
        report(mode, bm.step_fn(peft_model, ids, "grad", args))
        timing.free_memory(device)
    base = peft_model.unload()
    del peft_model
    timing.free_memory(device)
