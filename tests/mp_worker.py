"""Run under ``torchrun --nproc_per_node N``: training under FSDP2's bf16 ``MixedPrecisionPolicy``, flashdora vs PEFT.

One decoder layer of a Llama (hidden 1024, DoRA r = 64 on every projection, PEFT's default initialisation: ``lora_B``
zero, the magnitude the rows' norms), sharded with ``fully_shard``, trains ``--steps`` (4) AdamW steps at lr 2e-5,
each rank on its own sequence, three times from the same weights and data:

- ``reference``: PEFT's DoRA without a policy (float32 throughout);
- ``peft``: PEFT's DoRA under ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``;
- ``flashdora``: the same, with ``flashdora.enable``.

Rank 0 prints the three loss curves as one JSON line (``losses {...}``) and checks that flashdora's curve stays with
the reference (largest gap under a quarter of PEFT's) while PEFT's moves away from it by more than 1e-3. PEFT's bf16
``g - 1`` is mostly zero and its bf16 ``base + adapter term`` rounds the early updates away; flashdora keeps ``g - 1``
in float32 and rounds the output once (docs/benchmarks.md, "FSDP2's bf16 MixedPrecisionPolicy"). A compose that
dropped ``g - 1`` fails here: with ``g`` forced to 1 flashdora's gap was PEFT's. (PEFT's gap opens in the first steps:
0.011 by the third, 0.013 by the fourth, where flashdora's stays under 7e-4; 12 steps showed nothing more.)

``check(steps, device)`` runs it in an initialised process group (``tests/dist_worker.py --mixed-precision`` runs it
after its own checks, in the same launch: a launch's start-up costs more than the training).
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import flashdora
from flashdora.tools.bench.model_build import TARGETS

CONFIG = dict(
    hidden_size=1024, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=4, vocab_size=1024,
    num_hidden_layers=1, use_cache=False,
)  # fmt: skip
STEPS = 4


def train(run: str, steps: int, device: torch.device) -> list[float]:
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        model = get_peft_model(model, LoraConfig(r=64, lora_alpha=64, use_dora=True, target_modules=TARGETS))
    policy = {} if run == "reference" else {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)}
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    if run == "flashdora":
        flashdora.enable(model)
    flashdora.reset_stats()  # (a launch may have run other checks before: only this run's counts)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-5)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 64), generator=gen).to(device)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    if run == "flashdora" and not any(k.startswith("norm:") for k in flashdora.stats()):
        raise AssertionError(f"flashdora did not run: {flashdora.stats()}")
    del model, opt
    gc.collect()
    return losses


def check(steps: int, device: torch.device) -> None:
    """The three runs and, on rank 0, the check of their curves; prints ``OK mixed-precision``."""
    curves = {run: train(run, steps, device) for run in ("reference", "peft", "flashdora")}
    if dist.get_rank() == 0:
        print("losses", json.dumps(curves), flush=True)
        ref = curves["reference"]
        gap = {run: max(abs(a - b) for a, b in zip(curves[run], ref)) for run in ("peft", "flashdora")}
        print(f"largest gap to the reference: PEFT {gap['peft']:.5f}, flashdora {gap['flashdora']:.5f}")
        if not gap["peft"] > 1e-3:
            raise AssertionError(f"PEFT's curve stayed with the reference ({gap['peft']:.3g}): nothing to show")
        if not gap["flashdora"] < 0.25 * gap["peft"]:
            raise AssertionError(f"flashdora's gap {gap['flashdora']:.3g} is not under a quarter of PEFT's")
        print("OK mixed-precision", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    args = p.parse_args()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        check(args.steps, device)
    finally:
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
