"""Serve several saved DoRA (and LoRA) adapters in one batch: each request names its adapter.

    python examples/serve_adapters.py                 # the CPU in seconds; a GPU when there is one
    python examples/serve_adapters.py --adapters 8

Saves a few adapters the way training leaves them (``save_pretrained``), loads them into one model
(``PeftModel.from_pretrained`` and ``load_adapter``), turns flashdora on and generates for a batch whose requests use
different adapters, the base model included (``"__base__"``). PEFT alone refuses ``adapter_names`` with DoRA
adapters; flashdora runs every named adapter of a layer in one fused path. The script checks each request's tokens
against PEFT's own DoRA run on that request alone, and prints them.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import flashdora

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256)  # fmt: skip


def base_model(device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same base weights each call (from_pretrained in practice)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).to(device).eval()


def save_adapters(folder: Path, count: int, device: str) -> list[str]:
    """``count`` adapters saved as PEFT checkpoints: DoRA ones of different ranks, and one plain LoRA adapter."""
    names = []
    for i in range(count):
        name = f"customer{i}"
        dora = i < count - 1 or count == 1
        config = LoraConfig(
            r=4 * (1 + i % 3), lora_alpha=16, use_dora=dora, target_modules="all-linear", init_lora_weights=False
        )  # fmt: skip  (random B: adapters that change the output)
        torch.manual_seed(100 + i)
        get_peft_model(base_model(device), config).save_pretrained(folder / name)
        names.append(name)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=3, help="adapters to save and serve (default 3)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens to generate per request (default 8)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.adapters < 1 or args.new_tokens < 1:
        parser.error("--adapters and --new-tokens must be at least 1")

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        names = save_adapters(folder, args.adapters, args.device)
        model = PeftModel.from_pretrained(base_model(args.device), folder / names[0], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(folder / name, adapter_name=name)
    model.eval()

    requests = [names[i % len(names)] for i in range(2 * len(names))] + ["__base__"]
    ids = torch.randint(0, CONFIG["vocab_size"], (len(requests), 12), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    want = []  # PEFT's own DoRA, one request at a time
    with torch.inference_mode():
        for i, name in enumerate(requests):
            if name == "__base__":
                with model.disable_adapter():
                    want.append(model.generate(input_ids=ids[i : i + 1], **gen))
            else:
                model.set_adapter(name)
                want.append(model.generate(input_ids=ids[i : i + 1], **gen))

    flashdora.enable(model)
    with torch.inference_mode():  # eval mode and no gradients: the fused path
        got = model.generate(input_ids=ids, adapter_names=requests, **gen)

    for name, row in zip(requests, got):
        print(f"{name:>10}: {row[ids.shape[1] :].tolist()}")
    same = torch.equal(got, torch.cat(want))
    print(f"one batch, {len(set(requests))} adapters (base included): tokens equal to PEFT's per request: {same}")
    print(f"flashdora calls: {flashdora.stats()}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
