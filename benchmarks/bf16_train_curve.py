"""bf16 training curves of flashdora and PEFT DoRA against float32 (issue 54's "bf16 gradient fidelity").

A small random-weight Llama (bf16 base values), PEFT DoRA on every linear layer with a random ``lora_B``, trained
with AdamW on a fixed set of random sequences (it memorises them, so the loss falls). Three runs from the same
weights and batches: float32 (no autocast), PEFT with a bf16 base and float32 adapters under bf16 autocast, and
flashdora the same way. Reports each bf16 run's loss gap to the float32 run and the adapters' distance from the
float32 run's at the end.

    python benchmarks/bf16_train_curve.py --steps 200 --out /tmp/curve.md
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=448)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--sequences", type=int, default=8, help="the fixed training set, one sequence a step in turn")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", choices=("auto", "triton", "eager"), default="auto")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def build(args):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=args.vocab, max_position_embeddings=args.tokens,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    base = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for prm in base.parameters():
            prm.copy_(prm.to(torch.bfloat16).float())
    lcfg = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules="all-linear", use_dora=True,
                      init_lora_weights=False)  # fmt: skip
    return get_peft_model(base, lcfg)


def train(model, data, args, autocast: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Loss at every step, and the trained adapters."""
    model.to(args.device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    losses = []
    for step in range(args.steps):
        ids = data[step % len(data)].to(args.device)[None]
        with torch.autocast(torch.device(args.device).type, torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().double().cpu() for n, p in model.named_parameters() if p.requires_grad}


def main(argv=None) -> None:
    import flashdora

    args = parse(argv)
    flashdora.configure(backend=args.backend)
    t0 = time.perf_counter()
    ref = build(args)
    gen = torch.Generator().manual_seed(args.seed + 1)
    data = torch.randint(0, args.vocab, (args.sequences, args.tokens), generator=gen)
    bf16 = copy.deepcopy(ref)
    for prm in bf16.parameters():
        if not prm.requires_grad:
            prm.data = prm.data.to(torch.bfloat16)
    flash = flashdora.enable(copy.deepcopy(bf16))
    curves, finals = {}, {}
    curves["fp32"], finals["fp32"] = train(ref, data, args, autocast=False)
    curves["peft_bf16"], finals["peft_bf16"] = train(bf16, data, args, autocast=True)
    curves["flash_bf16"], finals["flash_bf16"] = train(flash, data, args, autocast=True)
    lines = [
        "# bf16 training curves: flashdora and PEFT DoRA against float32",
        "",
        f"- command: `{' '.join(sys.argv)}`",
        f"- torch {torch.__version__}, device {args.device}, backend {args.backend}; {time.perf_counter() - t0:.0f} s",
        f"- flashdora routes: {flashdora.stats()}",
        "",
        "| run | first loss | last loss | largest gap to fp32 | mean gap | last gap | adapters' distance to fp32 |",
        "|---|---|---|---|---|---|---|",
    ]
    ref_c, ref_p = curves["fp32"], finals["fp32"]
    for k in ("peft_bf16", "flash_bf16"):
        gaps = [abs(a - b) for a, b in zip(curves[k], ref_c)]
        num = sum(float((finals[k][n] - ref_p[n]).norm() ** 2) for n in ref_p) ** 0.5
        den = sum(float((ref_p[n]).norm() ** 2) for n in ref_p) ** 0.5
        lines.append(f"| {k} | {curves[k][0]:.4f} | {curves[k][-1]:.4f} | {max(gaps):.4f} | "
                     f"{sum(gaps) / len(gaps):.4f} | {gaps[-1]:.4f} | {num / den:.3e} |")  # fmt: skip
    lines.append(f"| fp32 | {ref_c[0]:.4f} | {ref_c[-1]:.4f} | - | - | - | - |")
    lines += ["", "Loss every 20 steps:", "", "| step | fp32 | peft_bf16 | flash_bf16 |", "|---|---|---|---|"]
    for s in [*range(0, args.steps, 20), args.steps - 1]:
        lines.append(f"| {s} | " + " | ".join(f"{curves[k][s]:.4f}" for k in ("fp32", "peft_bf16", "flash_bf16")) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
