"""Does a grad step wait on the GPU anywhere? PEFT LoRA against flashdora, as ``flashdora bench model`` runs them.

A host-bound step keeps the GPU fed only while the host runs ahead of it; any operation that waits for the GPU
(a device-to-host copy, ``.item()``, a blocking free or allocation, a stream synchronize) drains the queue and adds
the host's time to the GPU's. This runs one accumulation step of each mode after a warm-up with
``torch.cuda.set_sync_debug_mode("warn")`` (torch's own check for synchronizing calls) and the CUDA runtime's
synchronizing calls counted by ``torch.profiler``, and prints where each came from.

Usage: PYTHONPATH=src python3 benchmarks/sync_check.py [--preset llama3-8b] [--layers 4] [--grad-accum 4]
"""

import argparse
import collections
import sys
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import flashdora
from flashdora.bench import model as bm

p = argparse.ArgumentParser()
bm.add_arguments(p)
p.set_defaults(grad_accum=4, layers=4)
args = p.parse_args()
device = torch.device("cuda")
argv = " ".join(sys.argv[1:])
print(f"# command: PYTHONPATH=src python3 benchmarks/sync_check.py {argv} ({torch.cuda.get_device_name()})")
name, config = bm.build_config(args)
ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
base = bm.build_base(config, args, device)
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaFree")


def check(mode: str):
    model = bm.wrap(base, args, use_dora=mode != "peft_lora")
    if mode == "flashdora":
        flashdora.enable(model)
    step = bm.step_fn(model, ids, "grad", args)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    where = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            where[f"{w.filename}:{w.lineno}: {str(w.message)[:120]}"] += 1
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    calls = collections.Counter()
    for e in prof.events():
        if e.name.startswith(SYNC_CALLS):
            calls[e.name] += 1
    print(f"== {mode}: sync_debug_mode warnings in one step: {sum(where.values())}")
    for k, n in where.most_common(10):
        print(f"   {n:5d}  {k}")
    print(f"   CUDA runtime calls that can wait, one step (+ the final synchronize): {dict(calls)}")
    print(f"   paths: {flashdora.stats()}")
    flashdora.reset_stats()
    return model.unload()


for mode in ("peft_lora", "flashdora"):
    try:
        base = check(mode)
    except Exception:  # noqa: BLE001 - print and go on to the other mode
        traceback.print_exc()
