"""Where does a small flashdora layer spend its time? torch.profiler over PEFT LoRA and flashdora (GPU).

Usage: PYTHONPATH=src python3 benchmarks/profile_layer.py [d_in d_out r tokens]
"""

import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from torch.profiler import ProfilerActivity, profile

import flashdora

d_in, d_out, r, tokens = (int(v) for v in (sys.argv[1:5] or (4096, 4096, 16, 2048)))


def layer(use_dora):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, dtype=torch.bfloat16, device="cuda"))
    cfg = LoraConfig(r=r, lora_alpha=r, use_dora=use_dora, target_modules=["0"], init_lora_weights=False)
    return get_peft_model(net, cfg)


x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(tokens, d_out, device="cuda", dtype=torch.bfloat16)
for name, model in (("peft_lora", layer(False)), ("flashdora", flashdora.enable(layer(True)))):
    params = [p for p in model.parameters() if p.requires_grad]

    def step(model=model, params=params):
        torch.autograd.graph.increment_version(params)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        y.backward(dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        step()
    cpu = (time.perf_counter() - t) / 20 * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 20 * 1e3
    print(f"== {name}: cpu-side {cpu:.3f} ms/step, wall {wall:.3f} ms/step")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
