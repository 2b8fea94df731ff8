"""Host time per call of one PEFT layer: LoRA against flashdora's DoRA, at a token count the GPU never limits.

At 16 tokens each kernel takes a few microseconds, so a loop of calls runs at the speed the host issues them: the
wall time per call is the host's cost, the quantity that decides the ratios of a host-bound model step (eighth
session). Modes alternate for ``--turns`` turns; the median turn is printed per mode and phase:
``inference`` (no grad), ``train_fwd`` (the forward of a training step alone: grad on, no backward; what gradient
checkpointing replays) and ``fwd_bwd`` (forward and backward, weights unchanged: the norm comes from the cache).
``--step`` marks the trainable weights changed before each ``fwd_bwd`` call, as ``flashdora bench layer`` does (an
optimizer step per call: flashdora recomputes its norm every call), and prints the host time flashdora spends in
its norm lookup per call. ``--py-forward`` adds ``flashdora_pyfwd``: flashdora with ``flashdora.native``'s C++ forward
declining every call (the Python forward; the C++ backward node still hangs on it), an A/B of the C++ forward.

Usage: PYTHONPATH=src python3 benchmarks/host_layer.py [--shape 4096x4096] [--rank 384] [--tokens 16] [--turns 5]
[--calls 300] [--no-gc] [--step] [--py-forward]
"""

import argparse
import gc
import statistics
import time

import torch
from one_layer import add_layer_arguments, peft_layer

import flashdora
from flashdora.ops import compose as compose_ops
from flashdora.ops.norm import NormCache

p = argparse.ArgumentParser()
add_layer_arguments(p)
p.add_argument("--no-gc", action="store_true", help="Python's garbage collector off while timing")
p.add_argument("--step", action="store_true", help="fwd_bwd: mark the weights changed before each call")
p.add_argument("--py-forward", action="store_true", help="add flashdora with the C++ forward declining every call")
args = p.parse_args()
dev = "cuda" if torch.cuda.is_available() else "cpu"
d_in, d_out = (int(v) for v in args.shape.split("x"))


def layer(use_dora):
    return peft_layer(d_in, d_out, args.rank, use_dora, dev)


x = torch.randn(args.tokens, d_in, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(args.tokens, d_out, device=dev, dtype=torch.bfloat16)
models = {"peft_lora": layer(False), "flashdora": flashdora.enable(layer(True))}
if args.py_forward:
    models["flashdora_pyfwd"] = flashdora.enable(layer(True))


class _PythonForward:
    """``flashdora.native``'s extension with its forward declining every call (the rest is the extension's)."""

    def __init__(self, ext):
        self.ext = ext

    def forward(self, *args):
        return None

    def __getattr__(self, name):
        return getattr(self.ext, name)


def use_python_forward(on: bool) -> None:
    ext = compose_ops._native.ext if isinstance(compose_ops._native, _PythonForward) else compose_ops._native
    if ext not in (None, False):
        compose_ops._native = _PythonForward(ext) if on else ext


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


_lookup = NormCache.__dict__["lookup_owner"].__func__
lookup_s = [0.0]


def _timed_lookup(cls, *a):
    t = time.perf_counter()
    try:
        return _lookup(cls, *a)
    finally:
        lookup_s[0] += time.perf_counter() - t


NormCache.lookup_owner = classmethod(_timed_lookup)


def per_call_us(model, phase, n):
    use_python_forward(model is models.get("flashdora_pyfwd"))
    params = [q for q in model.parameters() if q.requires_grad]

    def call():
        if args.step and phase == "fwd_bwd":
            torch.autograd.graph.increment_version(params)
        with torch.autocast(dev, dtype=torch.bfloat16):
            y = model(x)
        if phase == "fwd_bwd":
            y.backward(dy)

    with torch.set_grad_enabled(phase != "inference"):
        for _ in range(20):
            call()
        sync()
        if args.no_gc:
            gc.disable()
        lookup_s[0] = 0.0
        t = time.perf_counter()
        for _ in range(n):
            call()
        sync()
        us = (time.perf_counter() - t) / n * 1e6
        gc.enable()
    return us, lookup_s[0] / n * 1e6


PHASES = ("inference", "train_fwd", "fwd_bwd")
times, lookups = {}, {}
for _ in range(args.turns):
    for phase in PHASES:
        for name, model in models.items():
            us, lookup_us = per_call_us(model, phase, args.calls)
            times.setdefault((phase, name), []).append(us)
            lookups.setdefault((phase, name), []).append(lookup_us)
device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
gc_state = "off" if args.no_gc else "on"
step = ", weights marked changed before each fwd_bwd call" if args.step else ""
print(f"# host us per call, {args.shape} r={args.rank}, {args.tokens} tokens, {device}, gc {gc_state}{step}")
for phase in PHASES:
    lora = statistics.median(times[(phase, "peft_lora")])
    for name in models:
        got = times[(phase, name)]
        med = statistics.median(got)
        spread = f"{min(got):.1f}-{max(got):.1f}"
        norm = f", norm lookup {statistics.median(lookups[(phase, name)]):.1f} us" if name != "peft_lora" else ""
        print(f"{phase:9s} {name:15s} median {med:7.1f} us (turns {spread}), {med / lora:.2f}x LoRA{norm}")
