"""Python calls (and C functions called from Python) per model step, flashdora minus PEFT LoRA, from cProfile (GPU).

The CPU count (``host_calls.py``) stubs the launches and runs the CPU's own aten ops; this profiles the real step on
the device, where the extra host time flashdora pays per layer is measured (``host_attrib.py``). Each function's
calls and own time per step in both modes, sorted by the difference in own time. cProfile slows Python calls down
more than C calls: read the call counts, and the own-time differences as a ranking, not as microseconds.

Usage: PYTHONPATH=src python3 benchmarks/cprofile_diff.py [--layers 4] [--phases grad] [--top 40]
"""

import argparse
import cProfile
import pstats

import torch

import flashdora
from flashdora.bench import model as bm

p = argparse.ArgumentParser()
bm.add_arguments(p)
p.set_defaults(layers=4, phases=["grad"])
p.add_argument("--top", type=int, default=40)
p.add_argument("--steps", type=int, default=5)
args = p.parse_args()
device = torch.device(args.device)
name, config = bm.build_config(args)
ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)


def profile(model, phase):
    step = bm.step_fn(model, ids, phase, args)
    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    prof.disable()
    out = {}
    for (file, line, fn), (_cc, nc, tt, _ct, _) in pstats.Stats(prof).stats.items():
        label = fn if file == "~" else f"{file.split('site-packages/')[-1].split('/src/')[-1]}:{line}({fn})"
        calls, own = out.get(label, (0, 0.0))
        out[label] = (calls + nc / args.steps, own + tt / args.steps * 1e6)
    return out


lora = bm.wrap(bm.build_base(config, args, device), args, False)
dora = bm.wrap(bm.build_base(config, args, device), args, True)
flashdora.enable(dora)
n_layers = 7 * config.num_hidden_layers
for phase in args.phases:
    a, b = profile(lora, phase), profile(dora, phase)
    total_a = sum(v[0] for v in a.values())
    total_b = sum(v[0] for v in b.values())
    own_a = sum(v[1] for v in a.values())
    own_b = sum(v[1] for v in b.values())
    print(
        f"== {name} {phase}, {n_layers} DoRA layers: calls per step LoRA {total_a:.0f}, flashdora {total_b:.0f} "
        f"({(total_b - total_a) / n_layers:+.1f} per layer); profiled own time per step {own_a / 1e3:.1f} vs "
        f"{own_b / 1e3:.1f} ms ({(own_b - own_a) / n_layers:+.1f} us per layer)"
    )
    rows = []
    for label in set(a) | set(b):
        ca, ta = a.get(label, (0, 0.0))
        cb, tb = b.get(label, (0, 0.0))
        rows.append((tb - ta, cb - ca, ca, cb, ta, tb, label))
    rows.sort(key=lambda r: -abs(r[0]))
    print(f"{'own us/layer':>12} {'calls/layer':>11} {'LoRA calls':>10} {'fd calls':>9}  function")
    for dt, dc, ca, cb, _, _, label in rows[: args.top]:
        print(f"{dt / n_layers:+12.1f} {dc / n_layers:+11.1f} {ca:10.0f} {cb:9.0f}  {label}")
