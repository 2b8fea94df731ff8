"""Where does a model step go? Host issue time vs GPU time, GPU kernels by total time, Python hot spots (GPU).

For PEFT LoRA and flashdora on a few decoder layers of a preset (default llama3-8b, 4 layers, r = 384, autocast):
- ``wall``: CUDA-event time of one step; ``host``: time for Python to issue it (queue empty at the start);
  host ~ wall means the step is bound by the CPU, not the GPU.
- the kernels with the most GPU time (torch.profiler), and the sum of all kernel time per step;
- cProfile of flashdora's steps (Python functions by own time).

Both modes' wall and host times are taken before either is profiled: a process that has run torch.profiler issues
work more slowly afterwards (18-72% in the twelfth session, docs/decisions.md). One process, one round each: for
ratios to report, ``benchmarks/accum_profile.py --rounds N`` or ``flashdora bench model --rounds N``.

Usage: PYTHONPATH=src python3 benchmarks/profile_model.py [--layers 4] [--phases inference grad]
"""

import argparse
import cProfile
import pstats
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import flashdora
from flashdora.bench import model as bm
from flashdora.bench import timing

p = argparse.ArgumentParser()
bm.add_arguments(p)
p.set_defaults(layers=4)
p.add_argument("--top", type=int, default=14)
p.add_argument("--cprofile", action="store_true")
p.add_argument("--cpu-ops", action="store_true", help="also list the ops issued per step (counts, host time)")
p.add_argument("--sync-debug", action="store_true", help="print where a step makes the host wait on the GPU")
args = p.parse_args()
device = torch.device("cuda")
name, config = bm.build_config(args)
ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
base = bm.build_base(config, args, device)


def _events(step, activity, device_type, reps):
    """torch.profiler averages over ``reps`` steps, only the events of ``device_type``."""
    with profile(activities=[activity]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    return [e for e in prof.key_averages() if e.device_type == device_type]


def kernel_table(step, label):
    events = _events(step, ProfilerActivity.CUDA, torch.autograd.DeviceType.CUDA, 3)
    total = sum(e.self_device_time_total for e in events) / 3 / 1e3
    print(f"--- {label}: GPU kernel time per step {total:.2f} ms; top kernels (ms per step, calls per step)")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]:
        print(f"  {e.self_device_time_total / 3 / 1e3:8.3f} {e.count // 3:5d}  {e.key[:110]}")
    return total


def cpu_table(step, label):
    events = _events(step, ProfilerActivity.CPU, torch.autograd.DeviceType.CPU, 2)
    print(f"--- {label}: host ops per step (calls, self host ms)")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top * 2]:
        print(f"  {e.count / 2:7.1f} {e.self_cpu_time_total / 2 / 1e3:8.3f}  {e.key[:90]}")


def sync_sites(step, label):
    """One step under ``torch.cuda.set_sync_debug_mode("warn")``: each synchronizing call, with its Python stack."""
    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        seen.append("".join(traceback.format_stack(limit=12)[:-2]))

    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"--- {label}: {len(seen)} synchronizing calls in one step")
    for stack in seen[:6]:
        print(stack)


MODES = ((False, "peft_lora"), (True, "flashdora"))


def warm_steps():
    """``(mode, phase, step)`` for every mode and phase, each step run 3 times first; each mode's model is built on
    ``base`` before its phases and unloaded back to it after."""
    global base
    for use_dora, mode in MODES:
        model = bm.wrap(base, args, use_dora)
        if use_dora:
            flashdora.enable(model)
        for phase in args.phases:
            step = bm.step_fn(model, ids, phase, args)
            for _ in range(3):
                step()
            yield mode, phase, step
        base = model.unload()
        del model, step
        torch.cuda.empty_cache()


# Every mode is timed before any is profiled: a process that has run torch.profiler issues work more slowly
# afterwards (docs/decisions.md, twelfth session), which would weigh on whichever mode came second.
timed = {}
for mode, phase, step in warm_steps():
    flashdora.reset_stats()
    timed[(mode, phase)] = (*timing.host_and_wall(step, 10, device), flashdora.stats())

for mode, phase, step in warm_steps():
    host, wall, stats = timed[(mode, phase)]
    print(f"    stats over 10 steps: {stats}")
    gpu = kernel_table(step, f"{name} {mode} {phase}")
    print(f"=== {name} {mode} {phase}: wall {wall:.2f} ms, host issue {host:.2f} ms, GPU kernels {gpu:.2f} ms")
    if args.cpu_ops:
        cpu_table(step, f"{name} {mode} {phase}")
    if args.sync_debug:
        sync_sites(step, f"{name} {mode} {phase}")
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        prof.disable()
        stats = pstats.Stats(prof)
        print(f"--- {name} {mode} {phase}: Python calls per step {stats.total_calls / 5:.0f}")
        stats.sort_stats("tottime").print_stats(args.top * 2)

# Per-call host cost of a tiny launch: a torch op, and a Triton JIT launch.
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _tiny(p, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(p + offs, tl.load(p + offs) + 1)


t = torch.zeros(128, device=device)
for label, fn in (
    ("torch add_", lambda: t.add_(1)),
    ("torch bf16 cast", lambda: t.to(torch.bfloat16)),
    ("torch mm 128", lambda: torch.mm(t[:, None], t[None, :])),
    ("triton jit launch", lambda: _tiny[(1,)](t, 128)),
):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        fn()
    host = (time.perf_counter() - t0) / 2000 * 1e6
    torch.cuda.synchronize()
    print(f"host per call: {label:20s} {host:6.1f} us")
