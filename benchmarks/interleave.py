"""Paired comparison on one GPU: PEFT LoRA, PEFT DoRA and flashdora models (8B-shaped Llama, random weights) held at
once, one training step (forward, backward, fused AdamW; bf16 autocast, fp32 adapters, non-reentrant checkpointing)
or one inference forward of each per round, the order rotating every round; prints per-mode median and min and the
median of per-round ratios (paired). Modes: ``lora``, ``dora`` (PEFT), ``fd`` (flashdora), ``fdpy`` (flashdora with
``configure(native=False)``, set between steps).

``--dynamic LO-HI``: every round also runs each mode on a token count drawn from [LO, HI] (the same for every mode
of the round), as dynamic padding gives, and reports those ratios apart from the fixed-length ones of the same run.

    python benchmarks/interleave.py --layers 16 --rank 16 --modes lora,fd --dynamic 1536-2048
"""
import argparse
import json
import random
import statistics as st

import torch
import transformers
from peft import LoraConfig, get_peft_model

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=32)
p.add_argument("--rank", type=int, default=384)
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--bs", type=int, default=1)
p.add_argument("--rounds", type=int, default=12)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--phase", default="train")
p.add_argument("--dropout", type=float, default=0.0)
p.add_argument("--quant", default="")
p.add_argument("--modes", default="lora,dora,fd")
p.add_argument("--compile", action="store_true", help="torch.compile each model (default mode)")
p.add_argument("--dynamic", default="", help="LO-HI: also time a token count drawn from [LO, HI] every round")
a = p.parse_args()
cfg = transformers.LlamaConfig(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=a.layers, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256,
)
cfg._attn_implementation = "sdpa"


def quantize(m):
    import bitsandbytes as bnb
    for mod in list(m.modules()):
        for cn, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear) and cn != "lm_head":
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, compute_dtype=torch.bfloat16,
                                      quant_type="nf4", device="cpu")
                q.weight = bnb.nn.Params4bit(child.weight.data.cpu(), requires_grad=False, quant_type="nf4").to("cuda")
                setattr(mod, cn, q)
    torch.cuda.empty_cache()


def build(mode):
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if a.quant:
        quantize(m)
    m = get_peft_model(m, LoraConfig(r=a.rank, lora_alpha=a.rank, target_modules="all-linear", use_dora=mode != "lora",
                                     lora_dropout=a.dropout, init_lora_weights="gaussian"))
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for n, prm in m.named_parameters():
            if "lora_B" in n:
                prm.copy_(torch.randn(prm.shape, device="cuda", generator=g) * 1e-3)
    if mode in ("fd", "fdpy"):
        import flashdora
        flashdora.enable(m)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.enable_input_require_grads()
    if a.phase == "inference":
        m.eval()
    opt = torch.optim.AdamW([q for q in m.parameters() if q.requires_grad], lr=1e-5, fused=True)
    if a.compile:
        m = torch.compile(m)
    return m, opt


modes = a.modes.split(",")
models = {k: build(k) for k in modes}
gen = torch.Generator(device="cuda").manual_seed(2)
fixed = torch.randint(0, cfg.vocab_size, (a.bs, a.seq), device="cuda", generator=gen)
lo, hi = map(int, a.dynamic.split("-")) if a.dynamic else (0, 0)
draw = random.Random(3)


def step(k, ids):
    m, opt = models[k]
    if k in ("fd", "fdpy"):  # fdpy: flashdora with its C++ path off (configure between steps, never inside one)
        import flashdora
        flashdora.configure(native=k == "fd")
    if a.phase == "inference":
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            m(input_ids=ids, use_cache=False)
        return
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


regimes = ["fixed", "dynamic"] if a.dynamic else ["fixed"]
times = {g: {k: [] for k in modes} for g in regimes}
seqs = []
for r in range(a.warmup + a.rounds):
    order = modes[r % len(modes):] + modes[:r % len(modes)]
    for g in regimes:
        if g == "fixed":
            ids = fixed
        else:
            seqs.append(draw.randint(lo, hi))
            ids = torch.randint(0, cfg.vocab_size, (a.bs, seqs[-1]), device="cuda", generator=gen)
        for k in order:
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step(k, ids)
            e.record()
            torch.cuda.synchronize()
            if r >= a.warmup:
                times[g][k].append(s.elapsed_time(e))
dev = torch.cuda.get_device_name()
print(f"interleaved {a.phase} layers={a.layers} r={a.rank} bs={a.bs} dropout={a.dropout} quant={a.quant or None} "
      f"rounds={a.rounds} on {dev}")
for g in regimes:
    print(f" {g}" + (f" (token counts {a.dynamic})" if g == "dynamic" else f" ({a.seq} tokens)"))
    for k in modes:
        print(f"  {k:5} median {st.median(times[g][k]):8.1f} ms  min {min(times[g][k]):8.1f}")
    for ref in [k for k in modes if k != "fd"] if "fd" in modes else []:  # fd/fdpy: what the C++ path buys
        fd, other = times[g]["fd"], times[g][ref]
        pr = [f / o for f, o in zip(fd, other)]
        print(f"  fd/{ref}: paired median {st.median(pr):.3f}  "
              f"ratio of medians {st.median(fd) / st.median(other):.3f}  ratio of mins {min(fd) / min(other):.3f}")
if "fd" in modes or "fdpy" in modes:
    import flashdora
    print("  stats", {k: v for k, v in flashdora.stats().items() if v})
print(json.dumps(dict(args=vars(a), device=dev, times=times, seqs=seqs)))
