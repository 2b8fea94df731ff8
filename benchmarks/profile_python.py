"""cProfile of flashdora's Python side on one small layer (GPU): which wrappers cost CPU time per step.

Usage: PYTHONPATH=src python3 benchmarks/profile_python.py [d_in d_out r tokens]
"""

import cProfile
import pstats
import sys

import torch
from peft import LoraConfig, get_peft_model

import flashdora

d_in, d_out, r, tokens = (int(v) for v in (sys.argv[1:5] or (4096, 4096, 16, 2048)))
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, dtype=torch.bfloat16, device="cuda"))
cfg = LoraConfig(r=r, lora_alpha=r, use_dora=True, target_modules=["0"], init_lora_weights=False)
model = flashdora.enable(get_peft_model(net, cfg))
x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(tokens, d_out, device="cuda", dtype=torch.bfloat16)
params = [p for p in model.parameters() if p.requires_grad]


def steps(n, bump=True):
    for _ in range(n):
        if bump:
            torch.autograd.graph.increment_version(params)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        y.backward(dy)
    torch.cuda.synchronize()


steps(5)
for bump in (True, False):
    print(f"==== bump={bump}")
    prof = cProfile.Profile()
    prof.enable()
    steps(50, bump)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
