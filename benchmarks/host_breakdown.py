"""Host (CPU) time per call of flashdora's Python pieces on one DoRA layer, beside PEFT LoRA's whole step (GPU).

Wraps the functions of a forward+backward step in perf_counter accumulators (no synchronisation: this is the
time the host spends issuing work) and prints microseconds per step for each, nested pieces included in their
callers. ``FLASHDORA_KEEP_NORM=1``: the weights' versions stay (the norm comes from the cache, as in the micro-batches
of an accumulation step). The first line prices the host itself: one empty Python function call, in ns.
Usage: PYTHONPATH=src python3 benchmarks/host_breakdown.py [d_in d_out r tokens]
"""

import collections
import functools
import os
import sys
import time
import timeit

import torch
from peft import LoraConfig, get_peft_model

import flashdora
from flashdora import peft_integration
from flashdora.kernels import compose as kc
from flashdora.kernels import configs
from flashdora.kernels import norm as kn
from flashdora.ops import compose as oc
from flashdora.ops import norm as on

d_in, d_out, r, tokens = (int(v) for v in (sys.argv[1:5] or (4096, 14336, 384, 2048)))
device = "cuda" if torch.cuda.is_available() else "cpu"
spent = collections.Counter()
KEEP_NORM = os.environ.get("FLASHDORA_KEEP_NORM") == "1"
print(
    f"# empty Python call: {timeit.timeit('f()', 'def f(): pass', number=10**6) * 1e3:.0f} ns; keep norm {KEEP_NORM}"
)


def timed(owner, name, label=None):
    fn = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t

    setattr(owner, name, wrapper)


def layer(use_dora):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, dtype=torch.bfloat16, device=device))
    cfg = LoraConfig(r=r, lora_alpha=r, use_dora=use_dora, target_modules=["0"], init_lora_weights=False)
    return get_peft_model(net, cfg)


x = torch.randn(tokens, d_in, device=device, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(tokens, d_out, device=device, dtype=torch.bfloat16)


def run(model, n, label):
    params = [p for p in model.parameters() if p.requires_grad]
    for phase in ("fwd_bwd", "fwd_nograd"):
        for rep in range(2):
            spent.clear()
            steps = 5 if rep == 0 else n
            for _ in range(steps):
                if phase == "fwd_bwd" and not KEEP_NORM:  # an optimizer step's worth of change: the norm is recomputed
                    torch.autograd.graph.increment_version(params)
                t = time.perf_counter()
                with torch.autocast(device, dtype=torch.bfloat16), torch.set_grad_enabled(phase == "fwd_bwd"):
                    y = model(x)
                spent["[forward]"] += time.perf_counter() - t
                if phase == "fwd_bwd":
                    t = time.perf_counter()
                    y.backward(dy)
                    spent["[backward]"] += time.perf_counter() - t
                if device == "cuda":
                    torch.cuda.synchronize()
        print(f"--- {label} {phase}: host us per step")
        for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
            print(f"  {v / n * 1e6:8.1f}  {k}")


run(layer(False), 50, "peft_lora")
timed(peft_integration, "flash_forward")
peft_integration.FlashDoraLinearVariant.forward = staticmethod(peft_integration.flash_forward)
timed(on.NormCache, "lookup_owner", "NormCache.lookup_owner")  # (the eager calls' norm; dora_scales before 4e57464)
timed(peft_integration, "compose_eager")  # (compose before 4e57464)
timed(peft_integration, "_cast_input_dtype")
peft_integration.LoraLayer._cast_input_dtype = peft_integration._cast_input_dtype
timed(on, "_fresh")
timed(oc, "_fwd")
timed(oc, "_bwd")
timed(oc.ComposeFunction, "backward", "ComposeFunction.backward")
oc.ComposeFunction.backward = staticmethod(oc.ComposeFunction.__dict__["backward"])
timed(kc, "compose_fwd_fused")
timed(kc, "compose_bwd")
timed(kn, "norm_and_scales")
timed(configs, "launch")
timed(oc, "_mm")
timed(oc, "_lora_a")
timed(on, "_tensor_keys")
timed(kc, "_fwd_io")
timed(kc, "_bwd_split")
timed(configs, "_launch_specialization")
timed(torch, "empty_like")
run(flashdora.enable(layer(True)), 50, "flashdora")
