"""One fresh process's training run for ``tests/test_fresh_machine.py`` (``python -m tests.fresh_worker KIND 0|1``).

The test gives it empty Triton and C++ extension caches, as on a fresh machine. A 2-layer Llama (hidden 256, bf16)
with a bf16, nf4 or int8 base (PEFT's ``lora.bnb`` classes, as a model loaded quantized) and DoRA r = 16 on every
projection trains under gradient checkpointing (``use_reentrant`` as given) and bf16 autocast with AdamW, flashdora
enabled from the first call, which builds the C++ extension before it runs. Before each step PEFT's twin (the same
model without flashdora) gets the adapters' current values; both run the step on the same tokens (a new count each
step: dynamic padding); their losses and gradients are compared. The last line printed is a JSON summary.
"""

from __future__ import annotations

import copy
import json
import sys
import time
import warnings

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import flashdora
from flashdora import native
from tests.qdora_models import TARGETS, quantize

STEPS = 5
TOKENS = (2048, 1536, 1999, 1700, 2040)  # (past bitsandbytes' fused-kernel cutoff: the base result is flashdora's)


def build(kind: str):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, use_cache=False)  # fmt: skip
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    if kind == "bf16":
        base = base.cuda()
    else:
        quantize(base, kind, torch.bfloat16, "cuda")
        base = base.cuda()
        base.is_loaded_in_4bit, base.is_loaded_in_8bit = kind == "nf4", kind == "int8"
    lora = LoraConfig(r=16, lora_alpha=32, use_dora=True, target_modules=TARGETS, init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(base, lora)


def step(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}


def main(kind: str, reentrant: bool) -> dict:
    model = build(kind)
    twin = copy.deepcopy(model)  # PEFT's own
    flashdora.enable(model)
    for m in (model, twin):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.enable_input_require_grads()
        m.train()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    twins = {n: p for n, p in twin.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trainable.values(), lr=1e-3)
    flashdora.reset_stats()
    start, loss_err, grad_err, first_s, per_step, worst = time.perf_counter(), 0.0, 0.0, None, [], []
    for n in range(STEPS):
        ids = torch.randint(0, 256, (1, TOKENS[n]), generator=torch.Generator().manual_seed(n)).cuda()
        with torch.no_grad():
            for name, p in trainable.items():
                twins[name].copy_(p)
        t0 = time.perf_counter()
        loss, grads = step(model, ids)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0 if first_s is None else first_s
        want_loss, want = step(twin, ids)
        loss_err = max(loss_err, (abs(loss - want_loss) / abs(want_loss)).item())
        diff = sum((grads[k] - want[k]).square().sum() for k in want).sqrt()
        rel = (diff / sum(w.square().sum() for w in want.values()).sqrt()).item()
        per_step.append((n, round(rel, 5), flashdora.stats().get("native_backward", 0)))
        if rel > grad_err:
            grad_err = rel
            worst = sorted((((grads[k] - want[k]).norm() / want[k].norm()).item(), k) for k in want)[-6:]
        opt.step()
    stats = flashdora.stats()
    return {"kind": kind, "reentrant": reentrant, "steps": STEPS, "loss_rel": loss_err, "grad_rel": grad_err,
            "first_step_s": first_s, "seconds": time.perf_counter() - start, "loaded": native.loaded() is not None,
            "native_backward": stats.get("native_backward", 0), "declined": stats.get("native_declined", 0),
            "stats": stats, "worst_step_params": worst, "per_step": per_step}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] == "1")))
