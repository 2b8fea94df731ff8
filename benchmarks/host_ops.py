"""Host time of each piece of one layer's inference forward (no grad, bf16 autocast, fp32 adapters), LoRA's and
flashdora's, at a token count the GPU never limits: where the host floor of a forward is.

Each piece runs ``--calls`` times in a loop inside one ``no_grad`` + autocast region (the queue drained before and
after; its wall time per call is the host's cost), pieces alternating for ``--turns`` turns; the median turn is
printed. The whole-call rows enter the region per call, as ``flashdora bench layer`` does.

Usage: PYTHONPATH=src:benchmarks python3 benchmarks/host_ops.py [--shape 4096x4096] [--rank 384] [--tokens 16]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from one_layer import add_layer_arguments, peft_layer

import flashdora
from flashdora.kernels import compose as kc
from flashdora.ops import compose as oc
from flashdora.ops.norm import NormCache
from flashdora.peft_integration import _lean_forward, flash_forward

p = argparse.ArgumentParser()
add_layer_arguments(p)
args = p.parse_args()
dev = "cuda"
d_in, d_out = (int(v) for v in args.shape.split("x"))
lora_model = peft_layer(d_in, d_out, args.rank, False, dev)
flash_model = flashdora.enable(peft_layer(d_in, d_out, args.rank, True, dev))
lora_layer, flash_layer = lora_model.base_model.model[0], flash_model.base_model.model[0]
base = flash_layer.base_layer
W, bias = base.weight, base.bias
A, B = flash_layer.lora_A["default"].weight, flash_layer.lora_B["default"].weight
owner = flash_layer.lora_magnitude_vector["default"]
m = owner.weight
x = torch.randn(args.tokens, d_in, device=dev, dtype=torch.bfloat16)
amp = lambda: torch.autocast(dev, dtype=torch.bfloat16)  # noqa: E731

with torch.no_grad(), amp():
    result = base(x)
    A16 = A.to(torch.bfloat16)
    a = F.linear(x, A16)
    scales = NormCache.lookup_owner(W, A, B, m, 1.0, owner)


def whole(layer):
    def call():
        with torch.no_grad(), amp():
            layer(x)

    return call


def region():
    with torch.no_grad(), amp():
        pass


pieces = {  # name: (callable, runs inside the region)
    "LoRA layer call (region per call)": (whole(lora_layer), False),
    "flashdora layer call (region per call)": (whole(flash_layer), False),
    "no_grad + autocast region alone": (region, False),
    "LoRA layer call": (lambda: lora_layer(x), True),
    "flashdora layer call": (lambda: flash_layer(x), True),
    "flashdora _lean_forward": (lambda: _lean_forward(flash_layer, x), True),
    "flashdora flash_forward": (lambda: flash_forward(flash_layer, "default", x, result), True),
    "base_layer(x) (module call)": (lambda: base(x), True),
    "F.linear(x, W, bias)": (lambda: F.linear(x, W, bias), True),
    "lora_A.to(bf16)": (lambda: A.to(torch.bfloat16), True),
    "F.linear(x, A_bf16)": (lambda: F.linear(x, A16), True),
    "ops.compose._lora_a": (lambda: oc._lora_a(x, A, torch.bfloat16, True), True),
    "NormCache.lookup_owner (hit)": (lambda: NormCache.lookup_owner(W, A, B, m, 1.0, owner), True),
    "compose_fwd_fused": (lambda: kc.compose_fwd_fused(result, a, B, scales, 1, None, None, False), True),
    "torch.empty_like(result)": (lambda: torch.empty_like(result), True),
    "result + result": (lambda: result + result, True),
    "x.float()": (lambda: x.float(), True),
}


def per_call_us(fn, inside: bool) -> float:
    torch.cuda.synchronize()
    if inside:
        with torch.no_grad(), amp():
            t = time.perf_counter()
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t) / args.calls * 1e6
    t = time.perf_counter()
    for _ in range(args.calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / args.calls * 1e6


for fn, inside in pieces.values():  # warm-up: compiles, autotuning, the norm cache
    per_call_us(fn, inside)
turns = {name: [] for name in pieces}
for _ in range(args.turns):
    for name, (fn, inside) in pieces.items():
        turns[name].append(per_call_us(fn, inside))
print(f"# host us per call, {args.shape} r={args.rank}, {args.tokens} tokens, {torch.cuda.get_device_name()}")
for name, ts in turns.items():
    print(f"{name:44s} median {statistics.median(ts):8.1f} us (turns {min(ts):.1f}-{max(ts):.1f})")
