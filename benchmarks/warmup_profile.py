"""Where flashdora's first steps spend their wall time (GPU): cProfile of a fresh process's first step(s).

``flashdora bench model`` reports ``warmup_s``; this splits it: Triton's compiles (cold disk cache) and autotuning,
the norm's graph captures and layout timing, and everything else. Run it twice in one device call: the first
process finds Triton's disk cache empty, the second finds it filled.

Usage: PYTHONPATH=src python3 benchmarks/warmup_profile.py [--preset llama3-8b] [--phase inference|grad] [--top 25]
"""

import argparse
import cProfile
import pstats
import time

import torch

import flashdora
from flashdora.bench import model as bm
from flashdora.bench import timing

p = argparse.ArgumentParser()
bm.add_arguments(p)
p.add_argument("--phase", choices=["inference", "grad"], default="inference")
p.add_argument("--top", type=int, default=25)
args = p.parse_args()
args.grad_accum = 1
device = torch.device(args.device)
name, config = bm.build_config(args)
ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
model = flashdora.enable(bm.wrap(bm.build_base(config, args, device), args, True))
step = bm.step_fn(model, ids, args.phase, args)
for label in ("first step", "second step", "third step"):
    prof = cProfile.Profile()
    timing.synchronize(device)
    t = time.perf_counter()
    prof.enable()
    step()
    timing.synchronize(device)
    prof.disable()
    print(f"== {name} {args.phase}, {label}: {time.perf_counter() - t:.2f} s (profiled)", flush=True)
    if label == "first step":
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
