"""Does PEFT's DoRA merge/unmerge leave a base weight at its old address, with other values?

Before a745521 the norm cache keyed a tensor on its address and version counter. ``p.data = new`` keeps the version
counter, and PEFT's unmerge (``W / f - delta``, assigned through ``.data``) gives back the merged weight's values a
few float32 ulps off the original. When the allocator hands the unmerged weight the original's block, that key took
it for the original. This counts how often that happens on the tiny Llama the norm-cache property test uses, and
checks the cached logits against a fresh computation after each unmerge (now keyed on storage numbers too).

    python3 benchmarks/unmerge_address.py [--rounds 20] [--device cuda]
"""

from __future__ import annotations

import argparse
import os

import torch
from peft import LoraConfig

import flashdora
from flashdora.demo import build_peft_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    model = build_peft_model("tiny", 4, 0.1, args.device, seed=1)
    model.add_adapter(
        "other", LoraConfig(r=2, use_dora=True, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    )
    model.base_model.model.config.use_cache = False
    flashdora.enable(model)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    opt = torch.optim.AdamW(params, lr=0.05, fused=args.device == "cuda")
    weights = {n: m.base_layer.weight for n, m in model.named_modules() if hasattr(m, "lora_magnitude_vector")}
    gen = torch.Generator().manual_seed(0)
    same_changed = same_equal = moved = 0
    worst = 0.0
    for _ in range(args.rounds):
        ids = torch.randint(0, 256, (2, 8), generator=gen).to(args.device)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)  # fills the cache for these weights
        before = {n: (w.data_ptr(), w.detach().clone()) for n, w in weights.items()}
        model.merge_adapter()
        model.unmerge_adapter()
        for n, w in weights.items():
            ptr, old = before[n]
            if w.data_ptr() != ptr:
                moved += 1
            elif torch.equal(old, w.detach()):
                same_equal += 1
            else:
                same_changed += 1
        with torch.no_grad():
            cached = model(input_ids=ids).logits
            os.environ["FLASHDORA_NORM_CACHE"] = "0"
            fresh = model(input_ids=ids).logits
            del os.environ["FLASHDORA_NORM_CACHE"]
        worst = max(worst, (cached - fresh).abs().max().item())
    total = args.rounds * len(weights)
    where = f"{len(weights)} DoRA layers on {args.device}, torch {torch.__version__}"
    print(f"# {args.rounds} merge/unmerge rounds x {where}")
    print(f"weights moved to a new address:                    {moved} of {total}")
    print(f"back at the old address, values bit-identical:     {same_equal} of {total}")
    print(f"back at the old address, values changed (ulps):    {same_changed} of {total}")
    print(f"max |cached - fresh| logits after unmerge:          {worst:.3g}")


if __name__ == "__main__":
    main()
