"""A fresh machine's first training run, as users meet it: empty Triton and C++ extension caches (the caller points
TRITON_CACHE_DIR and TORCH_EXTENSIONS_DIR at empty folders), an 8B-shaped Llama (random weights), DoRA on every
projection, bf16 autocast with fp32 adapters, non-reentrant checkpointing and fused AdamW, flashdora enabled from the
first call. Prints one JSON line: the extension's build time (where this process built it), the first step's time,
and the total for ``--steps`` steps.

    python benchmarks/fresh_start.py --layers 8 --rank 16 --steps 30
"""

import argparse
import json
import time

import torch
import transformers
from peft import LoraConfig, get_peft_model

import flashdora

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=8)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--steps", type=int, default=30)
a = p.parse_args()
cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=a.layers,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)  # fmt: skip
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model = get_peft_model(model, LoraConfig(r=a.rank, lora_alpha=a.rank, target_modules="all-linear", use_dora=True))
flashdora.enable(model)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.enable_input_require_grads()
opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5, fused=True)
ids = torch.randint(0, cfg.vocab_size, (1, a.seq), device="cuda")
times = []
start = time.perf_counter()
for _ in range(a.steps):
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
total = time.perf_counter() - start
try:
    from flashdora.native import build

    built = build.seconds
except ImportError:  # (an older flashdora: its build ran in the background)
    built = None
print(json.dumps(dict(args=vars(a), device=torch.cuda.get_device_name(), build_s=built, first_step_s=times[0],
                      total_s=total, median_step_s=sorted(times)[len(times) // 2],
                      stats={k: v for k, v in flashdora.stats().items() if v})))  # fmt: skip
