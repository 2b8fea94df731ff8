"""The one-layer PEFT model the host-cost scripts time (``host_layer.py``, ``host_backward.py``): a bf16
``nn.Linear`` with its bias, wrapped by PEFT LoRA or DoRA (non-zero ``lora_B``, scaling 1)."""

import torch
from peft import LoraConfig, get_peft_model


def peft_layer(d_in: int, d_out: int, rank: int, use_dora: bool, device):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, dtype=torch.bfloat16, device=device))
    cfg = LoraConfig(r=rank, lora_alpha=rank, use_dora=use_dora, target_modules=["0"], init_lora_weights=False)
    return get_peft_model(net, cfg)
