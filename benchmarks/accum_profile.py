"""Where an accumulation step goes, micro-batch by micro-batch: PEFT LoRA against flashdora (GPU).

On llama3-8b (r = 384, 2048 tokens, autocast, checkpointing) flashdora's single grad step ran 0.92x LoRA while its
accumulation-4 step ran 1.10x, 467 ms a micro-batch against 408 for a whole step with the norm (e042ba2, one run).
This times each micro-batch of a step apart: CUDA events around its forward and its backward (GPU time, launch gaps
included) and the host's time to issue each. Runs alternate over ``--rounds`` (each round builds each run's model
anew, every second round in reverse order), so that a host that drifts weighs on each alike; ``--profile`` then
adds each run's kernel time per step.

Runs: ``peft_lora`` or ``flashdora``, each optionally with environment settings for its run, e.g.
``flashdora:FLASHDORA_NORM_CACHE=0`` (the norm in every forward) or
``flashdora:FLASHDORA_NORM_GRAPH=0,FLASHDORA_NORM_GROUP=0``.
``--cpu-ops`` adds the host's ops of one step by self time (torch.profiler).

Usage: PYTHONPATH=src python3 benchmarks/accum_profile.py [--layers N] [--grad-accum 4] [--turns 4] [--rounds 2]
  [--runs RUN ...] [--raw] [--profile [--cpu-ops] [--cprofile DIR] [--trace DIR]]
"""

import argparse
import contextlib
import cProfile
import gc
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashdora
from flashdora.bench import model as bm

p = argparse.ArgumentParser()
bm.add_arguments(p)
p.set_defaults(grad_accum=4)
p.add_argument("--turns", type=int, default=4, help="timed steps per run and round")
p.add_argument("--profile", action="store_true", help="after the timings: kernel time of one step per run")
p.add_argument("--runs", nargs="+", default=["peft_lora", "flashdora", "flashdora:FLASHDORA_NORM_CACHE=0"])
p.add_argument("--cpu-ops", action="store_true", help="with --profile: the host's ops of one step")
p.add_argument(
    "--cprofile", default=None, help="with --profile, a folder: one step of each run under cProfile (RUN.pstats)"
)
p.add_argument(
    "--trace", default=None, help="with --profile, a folder: one micro-batch of each run (norm cached), RUN.json.gz"
)
p.add_argument("--top", type=int, default=12)
p.add_argument(
    "--raw", action="store_true", help="print every timed step: each micro-batch's GPU ms and the step's GC pauses"
)
args = p.parse_args()
device = torch.device("cuda")
print(
    f"# command: PYTHONPATH=src python3 benchmarks/accum_profile.py {' '.join(sys.argv[1:])} "
    f"(PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'default')}, {torch.cuda.get_device_name()})"
)
name, config = bm.build_config(args)
ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
base = bm.build_base(config, args, device)


_gc = {"t0": 0.0, "ms": [0.0, 0.0, 0.0], "n": [0, 0, 0]}


def _gc_timer(phase, info):
    """``gc.callbacks`` hook: time spent in each generation's collections, summed until ``gc_taken`` reads it."""
    if phase == "start":
        _gc["t0"] = time.perf_counter()
    else:
        g = info["generation"]
        _gc["ms"][g] += (time.perf_counter() - _gc["t0"]) * 1e3
        _gc["n"][g] += 1


def gc_taken():
    """``(ms, count)`` per generation since the last call."""
    out = [(round(ms, 1), n) for ms, n in zip(_gc["ms"], _gc["n"])]
    _gc["ms"], _gc["n"] = [0.0, 0.0, 0.0], [0, 0, 0]
    return out


gc.callbacks.append(_gc_timer)


@contextlib.contextmanager
def env(run):
    """The run's environment settings (``mode:NAME=VALUE,...``) for the duration of its run."""
    settings = dict(kv.split("=", 1) for kv in run.partition(":")[2].split(",") if kv)
    old = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def step(model, params, record):
    """One accumulation step; ``record`` gets, per micro-batch, (its 3 events, host ms of forward, of backward)."""
    torch.autograd.graph.increment_version(params)
    for _ in range(args.grad_accum):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        t0 = time.perf_counter()
        ev[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss / args.grad_accum
        ev[1].record()
        t1 = time.perf_counter()
        loss.backward()
        ev[2].record()
        t2 = time.perf_counter()
        record.append((ev, (t1 - t0) * 1e3, (t2 - t1) * 1e3))
    for q in params:
        q.grad = None


def built(run):
    """``run``'s model on the shared base, flashdora enabled for DoRA runs, and its trainable parameters."""
    dora = not run.startswith("peft_lora")
    model = bm.wrap(base, args, use_dora=dora)
    if dora:
        flashdora.enable(model)
    model.train()
    return model, [q for q in model.parameters() if q.requires_grad]


def unbuilt(model):
    """The base back from ``model``, the cache emptied."""
    out = model.unload()
    torch.cuda.empty_cache()
    return out


def timed(model, params, per_mb, steps, run):
    """Two warm-up steps, then ``--turns`` timed ones appended to ``per_mb`` and ``steps``."""
    for _ in range(2):
        step(model, params, [])
    for _ in range(args.turns):
        rec = []
        torch.cuda.synchronize()
        gc_taken()
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        h0 = time.perf_counter()
        step(model, params, rec)
        host = (time.perf_counter() - h0) * 1e3
        s1.record()
        torch.cuda.synchronize()
        steps.append((s0.elapsed_time(s1), host))
        for i, (ev, hf, hb) in enumerate(rec):
            per_mb[i].append((ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2]), hf, hb))
        if args.raw:
            mbs = " ".join(f"{ev[0].elapsed_time(ev[1]):.0f}+{ev[1].elapsed_time(ev[2]):.0f}" for ev, _, _ in rec)
            gcs = gc_taken()
            print(f"   {run}: step {steps[-1][0]:.0f} ms; micro-batches fwd+bwd {mbs}; GC (ms, n) per gen {gcs}")


def profiled(model, params, run):
    """Kernel time of one step (and what ``--cpu-ops``, ``--cprofile``, ``--trace`` ask for)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(model, params, [])
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sum(e.self_device_time_total for e in events) / 1e3
    print(f"\n== {run}: GPU kernel time in one profiled step {kernels:.1f} ms")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]:
        print(f"     {e.self_device_time_total / 1e3:8.2f} {e.count:5d}  {e.key[:100]}")
    if args.cpu_ops:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(model, params, [])
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
        print("   host ops of one step by self time (calls, ms):")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top * 2]:
            print(f"     {e.count:6d} {e.self_cpu_time_total / 1e3:8.2f}  {e.key[:90]}")
    stem = run.replace(":", "_").replace(",", "_")
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        step(model, params, [])
        torch.cuda.synchronize()
        prof.disable()
        os.makedirs(args.cprofile, exist_ok=True)
        prof.dump_stats(os.path.join(args.cprofile, stem + ".pstats"))
    if args.trace:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(input_ids=ids, labels=ids).loss.backward()
            torch.cuda.synchronize()
        os.makedirs(args.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace, stem + ".json.gz"))
        for q in params:
            q.grad = None


# Timing first, every run in every round, alternating; profiling after all of it: a process that has run
# torch.profiler issues work more slowly afterwards (a run timed after another's profile took 25-45% longer, whatever
# its mode; docs/benchmarks.md, twelfth session).
per_mb = {run: [[] for _ in range(args.grad_accum)] for run in args.runs}
steps = {run: [] for run in args.runs}
stats = {}
for k in range(args.rounds):
    for run in args.runs if k % 2 == 0 else args.runs[::-1]:  # every second round reversed: no run always second
        with env(run):
            model, params = built(run)
            flashdora.reset_stats()
            timed(model, params, per_mb[run], steps[run], run)
            stats[run] = flashdora.stats()
            base = unbuilt(model)
            del model, params
for run in args.runs:
    print(f"\n== {name} {run}, accumulation {args.grad_accum}: stats of its last round {stats[run]}")
    print("   steps (wall ms / host ms): " + ", ".join(f"{w:.0f}/{h:.0f}" for w, h in steps[run]))
    for i, rows in enumerate(per_mb[run]):
        med = [statistics.median(r[k] for r in rows) for k in range(4)]
        print(
            f"   micro-batch {i + 1}: GPU fwd {med[0]:7.1f} bwd {med[1]:7.1f} ms; host fwd {med[2]:7.1f} "
            f"bwd {med[3]:7.1f} ms (medians)"
        )
print("\nmedian step ms: " + ", ".join(f"{r} {statistics.median(w for w, _ in steps[r]):.1f}" for r in args.runs))
if args.profile:
    for run in args.runs:
        with env(run):
            model, params = built(run)
            for _ in range(2):
                step(model, params, [])
            profiled(model, params, run)
            base = unbuilt(model)
            del model, params
