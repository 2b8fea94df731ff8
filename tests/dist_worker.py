"""Run under ``torchrun --nproc_per_node N``: flashdora under FSDP2 and DDP against one process's PEFT DoRA.

For each wrapper (``--wrap``, ``WRAPS``: FSDP2 enabled after or before the sharding, with and without resharding
after the forward, from the meta device, with gradient accumulation, compiled (opt-in); DDP): a tiny Llama with
DoRA adapters on every projection trains ``--steps`` AdamW steps on slices of one global batch, gradient
checkpointing on. Rank 0 trains the same model without flashdora, unsharded, on the whole batch, and the worker
checks:

- losses and the adapter weights after training equal the one-process run (float32 round-off);
- the norm is computed once per layer per step (``norm:eager`` or ``norm:triton``) and the frozen base's
  ``||W||^2`` once (``norm:base_sq``), checkpoint recomputations and FSDP2's re-gathers included;
- ``report()`` lists every layer on flashdora's path;
- after an in-place edit of the (sharded) weights and after a ``load_state_dict``, with no optimizer step, the
  model's output equals PEFT's own on the same weights (no stale norm).

Prints ``OK <wrap>`` per wrapper on rank 0; raises (a non-zero exit) on the first failed check. ``--mixed-precision``
then runs ``tests/mp_worker.py``'s check in the same launch (``OK mixed-precision``): a launch's start-up, two ranks
importing torch, transformers and peft, costs more than either worker's training.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

import flashdora
from flashdora.tools.bench.model_build import TARGETS

CONFIG = dict(
    hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
    num_hidden_layers=2, use_cache=False,
)  # fmt: skip
N_LAYERS = CONFIG["num_hidden_layers"] * len(TARGETS)


DEVICE = torch.device("cpu")


def build(device=None):
    torch.manual_seed(0)
    device = device or DEVICE
    with device:
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    lora = LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, target_modules=TARGETS)
    with device:
        model = get_peft_model(model, lora)
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def batches(steps: int, batch: int):
    gen = [torch.Generator().manual_seed(s) for s in range(steps)]
    return [torch.randint(0, CONFIG["vocab_size"], (batch, 16), generator=g).to(DEVICE) for g in gen]


def adapters(model) -> dict[str, torch.Tensor]:
    """Every adapter tensor, whole (a collective under FSDP2: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            out[name.replace("module.", "")] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 2e-5) -> float:
    """The relative error of ``a`` against ``b``; raises when over ``tol``."""
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    if not err <= tol:
        raise AssertionError(f"{what}: relative error {err:.3g} > {tol:g}")
    return err


def reference(steps: int, data) -> tuple[list[float], dict[str, torch.Tensor]]:
    """PEFT's DoRA in one process on the whole batch."""
    model = build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, adapters(model)


def counts() -> tuple[int, int]:
    s = flashdora.stats()
    return s.get("norm:eager", 0) + s.get("norm:triton", 0), s.get("norm:base_sq", 0)


def flash_vs_peft(model, inner, ids, what: str, change=None) -> None:
    """Fill the norm cache, ``change()`` the weights, then the output with flashdora (its cache as it stands)
    against PEFT's own forward on the same weights. (``enable`` clears the cache: it comes last.)"""
    with torch.no_grad():
        model(input_ids=ids)
        if change is not None:
            change()
        flash = model(input_ids=ids).logits
        flashdora.disable(inner)
        peft = model(input_ids=ids).logits
        flashdora.enable(inner)
    close(flash, peft, what, 1e-5)


WRAPS = {
    "fsdp2": "fully_shard on every decoder layer and the root, then enable",
    "fsdp2-early": "enable first, then fully_shard with reshard_after_forward=False on the decoder layers",
    "fsdp2-meta": "built on the meta device, sharded, to_empty, weights loaded with set_model_state_dict",
    "fsdp2-accum": "two micro-batches a step (set_requires_gradient_sync(False) on the first)",
    "ddp": "DistributedDataParallel",
    "fsdp2-compile": "fully_shard, enable, then torch.compile of every decoder layer (not in the default set: slow)",
}
DEFAULT = [w for w in WRAPS if w != "fsdp2-compile"]


def wrapped(wrap: str, ref_state):
    """(the model to call, the PEFT model inside it) for one of ``WRAPS``."""
    if wrap == "ddp":
        model = DistributedDataParallel(build(), device_ids=[DEVICE] if DEVICE.type == "cuda" else None)
        return model, model.module
    model = build(torch.device("meta") if wrap == "fsdp2-meta" else None)
    if wrap == "fsdp2-early":
        flashdora.enable(model)
    keep = {"reshard_after_forward": False} if wrap == "fsdp2-early" else {}
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, **keep)
    fully_shard(model)
    if wrap == "fsdp2-meta":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device=DEVICE)
        set_model_state_dict(model, ref_state, options=StateDictOptions(full_state_dict=True, strict=False))
        llama = model.base_model.model.model  # non-persistent buffers are not in a state dict: built again
        llama.rotary_emb = type(llama.rotary_emb)(config=llama.config, device=DEVICE)
    if wrap == "fsdp2-compile":
        flashdora.enable(model)
        for layer in model.base_model.model.model.layers:
            layer.compile()
    return model, model


def check(wrap: str, steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(steps, 2 * world)
    if rank == 0:
        ref_losses, ref_adapters = reference(steps, data)
    model, inner = wrapped(wrap, build().state_dict())
    flashdora.enable(inner)  # (again for fsdp2-early: idempotent)
    path = "flashdora:not run"  # (before any call: report() predicts nothing)
    report = flashdora.report(inner, print_table=False)  # (sharded weights at rest are DTensors)
    if f"DoRA layers by path: {path}: {N_LAYERS}" not in report:
        raise AssertionError(f"{wrap}: report() says\n{report}")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    flashdora.reset_stats()
    losses = []
    for step, ids in enumerate(data):
        before = counts()
        mine = ids.chunk(world)[rank]
        if wrap == "fsdp2-accum":
            loss = 0.0
            for i, micro in enumerate(mine.chunk(2)):
                model.set_requires_gradient_sync(i == 1)
                part = model(input_ids=micro, labels=micro).loss / 2
                part.backward()
                loss = loss + part.detach()
        else:
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        norms, base = (a - b for a, b in zip(counts(), before))
        if norms != N_LAYERS or base != (N_LAYERS if step == 0 else 0):
            raise AssertionError(f"{wrap} step {step}: {norms} norms and {base} ||W||^2 for {N_LAYERS} layers")
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    trained = adapters(model)
    if rank == 0:
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            close(torch.tensor(a), torch.tensor(b), f"{wrap} loss at step {step}")
        for name, ref in ref_adapters.items():
            close(trained[name], ref, f"{wrap} {name}", 1e-4)

    ids = data[0].chunk(world)[rank]
    model.eval()
    flash_vs_peft(model, inner, ids, f"{wrap} after training")

    def edit():  # in place, on the sharded parameters under FSDP2; no optimizer step
        for name, p in inner.named_parameters():
            if "lora_B" in name or "lora_magnitude" in name:
                p.mul_(1.5)

    def load():
        inner.load_state_dict({k: v * 0.5 for k, v in inner.state_dict().items() if "lora_A" in k}, strict=False)

    flash_vs_peft(model, inner, ids, f"{wrap} after an in-place edit", edit)
    flash_vs_peft(model, inner, ids, f"{wrap} after load_state_dict", load)
    if rank == 0:
        print(f"OK {wrap}", flush=True)
    model = inner = opt = None
    gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wrap", nargs="+", choices=list(WRAPS), default=DEFAULT, help="default: all but fsdp2-compile")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    p.add_argument("--mixed-precision", action="store_true", help="then tests/mp_worker.py's check")
    args = p.parse_args()
    global DEVICE
    if args.device == "cuda":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        for wrap in args.wrap:
            check(wrap, args.steps)
        if args.mixed_precision:
            import mp_worker  # (this directory: the script's)

            gc.collect()
            mp_worker.check(mp_worker.STEPS, DEVICE)
    finally:
        gc.collect()  # the models before the process group (examples/fsdp2_train.py says why)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
