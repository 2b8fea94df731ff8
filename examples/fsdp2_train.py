"""Train a PEFT DoRA model with flashdora under PyTorch FSDP2 (``fully_shard``).

    torchrun --nproc_per_node 2 examples/fsdp2_train.py                  # GPUs (NCCL), else the CPU (gloo)
    torchrun --nproc_per_node 2 examples/fsdp2_train.py --device cpu --steps 3

A Llama-style model is built from a config with random weights (``--preset tiny`` runs anywhere in seconds;
``--preset llama3-8b --layers 4`` has the 8B model's shapes). Every decoder layer and the root are sharded with
``fully_shard``, then ``flashdora.enable`` (before the sharding works as well: the norm cache keys FSDP2's
unsharded parameters by their shards, docs/design.md). Each rank trains on its own slice of one global batch; rank 0
prints the loss, the step time and flashdora's counters (one norm per layer per step).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import flashdora

PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shapes (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default: %(default)s)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank; lora_alpha = rank (default: %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default: %(default)s)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="global batch, split over the ranks (default: %(default)s)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: CUDA when present")
    p.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(param_dtype=bfloat16) (CUDA)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    p.add_argument("--no-flashdora", action="store_true", help="PEFT's own DoRA, for comparison")
    args = p.parse_args(argv)
    for name in ("layers", "rank", "steps", "seq", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} expected a positive integer, got {getattr(args, name)}")
    return args


def build(args, device: torch.device, dtype: torch.dtype):
    """The PEFT DoRA model, every decoder layer and the root sharded, flashdora enabled after the sharding."""
    torch.manual_seed(0)  # the same weights on every rank (fully_shard keeps each rank's shard of them)
    config = LlamaConfig(num_hidden_layers=args.layers, use_cache=False, **PRESETS[args.preset])
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    lora = LoraConfig(
        r=args.rank, lora_alpha=args.rank, use_dora=True, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )  # fmt: skip
    model = get_peft_model(model, lora).to(dtype)  # FSDP2 wants one dtype per group unless a policy casts
    if args.checkpointing:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    kwargs = {} if policy is None else {"mp_policy": policy}
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if not args.no_flashdora:
        flashdora.enable(model)
    return model


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not divisible by the {world} ranks")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    model = build(args, device, torch.float32)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    vocab = model.config.vocab_size
    losses = []
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(step))
        ids = ids.chunk(world)[rank].to(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if use_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.5f}  {seconds * 1000:.1f} ms", flush=True)
    if rank == 0:
        print("flashdora counters:", {k: v for k, v in flashdora.stats().items() if k.startswith(("norm", "peft"))})
    # Free the sharded model before the process group: left to the interpreter's exit, FSDP2's and gloo's objects
    # can be torn down after the group's threads, which aborts the process ("terminate called without an active
    # exception") although training finished.
    del model, opt
    gc.collect()
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
