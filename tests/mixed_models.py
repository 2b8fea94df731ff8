"""Tiny Llama models with several LoRA and DoRA adapters for the mixed-batch tests (PEFT's ``adapter_names``), and
PEFT's own per-adapter outputs to compare with."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import flashdora

SPECS = {
    "d1": dict(r=8, lora_alpha=16, use_dora=True),
    "d2": dict(r=16, lora_alpha=8, use_dora=True, use_rslora=True),
    "l1": dict(r=4, lora_alpha=8),
    "d3": dict(r=4, lora_alpha=4, use_dora=True),
}
NAMES = ["d1", "__base__", "l1", "d2", "d3", "d1", "l1", "d2"]
VOCAB = 101


def build(specs=SPECS, dtype=torch.float32, device="cpu", hidden=64, layers=2, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, attention_bias=True,
    )  # fmt: skip
    model = None
    for name, kw in specs.items():
        lora = LoraConfig(**{"target_modules": "all-linear", "init_lora_weights": False, **kw})
        model = get_peft_model(LlamaForCausalLM(config), lora, adapter_name=name) if model is None else model
        if name not in model.peft_config:
            model.add_adapter(name, lora)
    for name, p in model.named_parameters():  # trained magnitudes: g away from 1
        if "magnitude" in name:
            p.data.mul_(1 + 0.1 * torch.randn_like(p))
    return model.to(device=device, dtype=dtype).eval()


def ids_for(names, length=7, seed=3, device="cpu"):
    return torch.randint(0, VOCAB, (len(names), length), generator=torch.Generator().manual_seed(seed)).to(device)


@torch.no_grad()
def per_adapter(model, ids, names):
    """PEFT's own logits, each row computed alone with its adapter (flashdora off)."""
    flashdora.disable(model)
    active = model.active_adapter
    rows = []
    for i, name in enumerate(names):
        if name == "__base__":
            with model.disable_adapter():
                rows.append(model(input_ids=ids[i : i + 1]).logits)
        else:
            model.set_adapter(name)
            rows.append(model(input_ids=ids[i : i + 1]).logits)
    model.set_adapter(active)
    return torch.cat(rows)


def mixed(model, ids, names):
    flashdora.enable(model)
    with torch.no_grad():
        return model(input_ids=ids, adapter_names=names).logits
