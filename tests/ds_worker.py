"""Run under ``torchrun --nproc_per_node 2`` (with ``DS_ACCELERATOR=cpu`` on the CPU, ``--device cuda`` on two GPUs):
flashdora under DeepSpeed against PEFT's DoRA.

The tiny Llama of ``tests/dist_worker.py`` (DoRA on every projection, gradient checkpointing on) trains ``--steps``
AdamW steps (torch's, as DeepSpeed's client optimizer; the Trainer's own in the Trainer case) on each rank's half of
one global batch, fp32, for each case of ``CASES``. Every case trains twice in the launch from the same weights and
data, once with PEFT's own DoRA and once with ``flashdora.enable`` (before ``deepspeed.initialize``, or after it),
and rank 0 also trains PEFT's DoRA in one process on the whole batch. Checks:

- ZeRO-3 partitions the parameters (a base weight is empty at rest, ``ds_numel`` > 0), and every DoRA call runs
  flashdora's own path on gathered parameters (a call that finds one partitioned falls back, counted
  ``peft_fallback:deepspeed_zero3``: none is), ``report()`` naming it for every layer, no warning: every call
  composed, its norm computed or served from the cache (while no re-gather intervened: DeepSpeed keeps parameters
  it will reuse soon, unless ``zero3-release``), and one ``||W||^2`` of each frozen base in the whole run (keyed by
  its ZeRO partition: ``ops/norm_cache.py``), the checkpoint's recomputation (reentrant or not) included;
- ZeRO-2 (nothing partitioned, no module hooks): flashdora's own path, one norm per layer per step and one
  ``||W||^2`` of each frozen base in the whole run;
- a base weight frozen after ``deepspeed.initialize`` (``*-freeze-after``), which DeepSpeed's optimizer still steps:
  its ``||W||^2`` at every step;
- losses at every step and every trained adapter tensor equal PEFT's under the same DeepSpeed config, and PEFT's in
  one process (but for the Trainer, which shuffles), to float32 round-off.

Prints ``OK <case>`` per case on rank 0; raises (a non-zero exit) on the first failed check.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import warnings

import deepspeed
import torch
import torch.distributed as dist

import dist_worker  # (this directory: the script's)
import flashdora
from dist_worker import CONFIG, N_LAYERS, TARGETS, batches, build, close, reference
from flashdora import backend

# DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (a C++ build of a minute and more on a fresh
# machine) at init; gloo's own collectives do the same work here, so the test skips that build. (The module from
# sys.modules: the package's attribute `torch` is torch.)
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

CASES = {
    "zero3": "deepspeed.initialize, ZeRO stage 3 (every parameter partitioned), flashdora enabled before it",
    "zero3-after": "the same, flashdora enabled after deepspeed.initialize",
    "zero3-accelerate": "accelerate's Accelerator with DeepSpeedPlugin(zero_stage=3)",
    "zero3-release": "deepspeed.initialize, ZeRO-3 releasing every parameter after each module's forward and "
    "backward (no reuse, no prefetch): re-gathered for the checkpoint's recomputation and the backward",
    "zero3-reentrant": "the same with reentrant gradient checkpointing (use_reentrant=True)",
    "zero2": "deepspeed.initialize, ZeRO stage 2 (nothing partitioned): flashdora's own path",
    "zero3-freeze-after": "ZeRO-3 with every DoRA layer's base weight trainable at deepspeed.initialize (so in "
    "DeepSpeed's optimizer, weight decay 5) and frozen right after it, before any forward: DeepSpeed keeps stepping "
    "it (its decay), below autograd, so its ||W||^2 is computed again at every step",
    "zero2-freeze-after": "the same under ZeRO-2",
    "zero3-trainer": "transformers' Trainer with a ZeRO-3 deepspeed= config, the model built under zero.Init (weights "
    "of its own, and the Trainer shuffles: no one-process reference)",
}


def ds_config(stage: int, world: int, release: bool = False) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # the tiny model's parameters are partitioned too
    if release:  # every parameter released after each use (DeepSpeed keeps them for reuse and prefetches by default)
        zero.update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0, stage3_max_live_parameters=0)
    return {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "steps_per_print": 10**9}  # fmt: skip


def whole(engine_module) -> dict[str, torch.Tensor]:
    """Every adapter tensor, gathered (a collective under ZeRO-3: every rank calls it)."""
    named = [(n, p) for n, p in engine_module.named_parameters() if "lora_" in n]
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {n.replace("module.", ""): p.detach().clone() for n, p in named}


class _Rows(torch.utils.data.Dataset):
    def __init__(self, data):
        self.rows = [row.cpu() for ids in data for row in ids]  # (the Trainer's DataLoader pins them, then moves them)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def trainer_run(flash: bool, data, world: int):
    """(the Trainer's logged loss per step, the model) as a Trainer user runs ZeRO-3: ``TrainingArguments`` with the
    config first, so that the model is built partitioned (``deepspeed.zero.Init``, as ``from_pretrained`` builds it)
    and PEFT's DoRA initialises its magnitudes on gathered weights; constant learning rate, no clipping, seed 0."""
    import tempfile

    from accelerate.state import AcceleratorState
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(True)  # the run before set up its own
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, max_steps=len(data), learning_rate=1e-2,
            lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, report_to=[],
            save_strategy="no", deepspeed=ds_config(3, world), use_cpu=dist_worker.DEVICE.type == "cpu",
            disable_tqdm=True, seed=0, adam_epsilon=1e-3,
        )  # fmt: skip
        # (Adam's eps 1e-3: with 1e-8 its first steps divide each gradient element by its own size, and this model
        # has near-zero ones, whose float32 round-off then moves a weight by a visible fraction of the learning rate:
        # the step-0 gradients equal PEFT's to 1.4e-6, one lora_B element is 5.6e-5 off after that step)
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(LlamaConfig(**CONFIG))  # under zero.Init
        lora = LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, target_modules=TARGETS)
        model = get_peft_model(model, lora)
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if flash:
            flashdora.enable(model)
        trainer = Trainer(model=model, args=args, train_dataset=_Rows(data))
        trainer.train()
    unset_hf_deepspeed_config()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], model


def train(case: str, flash: bool, data) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int], list[str]]:
    """(losses, adapters, stats, flashdora's warnings) of one run of ``case``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if case == "zero3-trainer":
        flashdora.reset_stats()
        backend._warned.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses, model = trainer_run(flash, data, world)
        base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
        if not (base.numel() == 0 and base.ds_numel > 0):
            raise AssertionError(f"{case}: a base weight at rest is {tuple(base.shape)}, not partitioned")
        said = [str(w.message) for w in caught if "flashdora" in str(w.message)]
        return losses, whole(model), flashdora.stats(), said
    model = build()
    if case == "zero3-reentrant":
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.base_model.model.enable_input_require_grads()  # (reentrant checkpoints need an input that does)
    if flash and case != "zero3-after":
        flashdora.enable(model)
    bases = [p for n, p in model.named_parameters() if "base_layer.weight" in n] if "freeze-after" in case else []
    for p in bases:
        p.requires_grad_(True)
    adapters = [p for p in model.parameters() if p.requires_grad and all(p is not b for b in bases)]
    groups = [{"params": adapters}] + ([{"params": bases, "weight_decay": 5.0}] if bases else [])
    opt = torch.optim.AdamW(groups, lr=1e-2)
    stage = 2 if case.startswith("zero2") else 3
    if case == "zero3-accelerate":
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import DeepSpeedPlugin

        AcceleratorState._reset_state()  # a second Accelerator may not bring a plugin of its own (the run before)
        plugin = DeepSpeedPlugin(hf_ds_config=ds_config(stage, world))
        accelerator = Accelerator(deepspeed_plugin=plugin)
        engine, opt = accelerator.prepare(model, opt)

        def backward(loss):
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    else:
        release = case in ("zero3-release", "zero3-reentrant")
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, world, release))

        def backward(loss):
            engine.backward(loss)
            engine.step()

    if flash and case == "zero3-after":
        flashdora.enable(model)
    for p in bases:  # frozen before any forward, still in DeepSpeed's optimizer
        p.requires_grad_(False)
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    if stage == 3 and not (base.numel() == 0 and base.ds_numel > 0):
        raise AssertionError(f"{case}: a base weight at rest is {tuple(base.shape)}, not partitioned")
    if flash:
        paths = ("flashdora:not run",)  # (before any call: report() predicts nothing)
        report = flashdora.report(model, print_table=False)
        if not any(f"DoRA layers by path: {path}: {N_LAYERS}" in report for path in paths):
            raise AssertionError(f"{case}: report() says\n{report}")
    flashdora.reset_stats()
    backend._warned.clear()
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ids in data:
            mine = ids.chunk(world)[rank]
            loss = engine(input_ids=mine, labels=mine).loss
            backward(loss)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
    said = [str(w.message) for w in caught if "flashdora" in str(w.message)]
    trained = whole(engine)
    stats = flashdora.stats()
    engine = model = opt = None
    gc.collect()
    return losses, trained, stats, said


def check(case: str, steps: int, ref) -> None:
    rank = dist.get_rank()
    data = batches(steps, 2 * dist.get_world_size())
    peft_losses, peft_adapters, peft_stats, _ = train(case, False, data)
    losses, adapters, stats, said = train(case, True, data)
    if peft_stats:
        raise AssertionError(f"{case}: PEFT's run went through flashdora: {peft_stats}")
    calls = 2 * N_LAYERS * steps  # every layer twice a step: the forward and the checkpoint's recomputation
    norms = sum(stats.get(f"norm:{impl}", 0) for impl in ("eager", "triton", "native"))
    fallbacks = [k for k in stats if k.startswith("peft_fallback")]
    base_sq = N_LAYERS * steps if "freeze-after" in case else N_LAYERS  # a frozen base's ||W||^2 once in the run
    if fallbacks or said or stats.get("norm:base_sq") != base_sq:
        raise AssertionError(f"{case}: stats {stats}, warnings {said}")
    if case.startswith("zero3"):  # every call composed; its norm fresh or from the cache while no gather intervened
        # (the C++ route counts "triton" and "native_backward")
        composed = stats.get("eager", 0) + stats.get("triton", 0)
        if composed != calls or norms + stats.get("norm:cached", 0) != calls or norms < N_LAYERS * steps:
            raise AssertionError(f"{case}: stats {stats}")
    elif norms != N_LAYERS * steps:  # once per layer per step (the recomputation from the cache)
        raise AssertionError(f"{case}: stats {stats}")
    if rank == 0:
        # (the Trainer shuffles, the reference trains a frozen base; on GPUs, cuBLAS picks other kernels for each
        # rank's half batch than for the whole one, and Adam's first steps magnify that round-off in near-zero
        # gradient elements to 7e-3 in PEFT's own runs: PEFT under DeepSpeed, same ranks, is the reference there)
        alone = case == "zero3-trainer" or "freeze-after" in case or dist_worker.DEVICE.type != "cpu"
        ref_losses, ref_adapters = ([None] * steps, {}) if alone else ref
        if len(losses) != steps or len(peft_losses) != steps:
            raise AssertionError(f"{case}: losses {losses} and PEFT's {peft_losses} for {steps} steps")
        # float32 round-off: on a GPU the Triton kernels sum in other orders than cuBLAS
        loss_tol, ds_tol, one_tol = (2e-5, 1e-5, 1e-4) if dist_worker.DEVICE.type == "cpu" else (1e-4, 1e-4, None)
        worst = {"loss vs PEFT under DeepSpeed": 0.0, "loss vs PEFT in one process": 0.0}
        for step in range(steps):
            for name, want in (("PEFT under DeepSpeed", peft_losses[step]), ("PEFT in one process", ref_losses[step])):
                if want is not None:
                    err = close(
                        torch.tensor(losses[step]), torch.tensor(want), f"{case} loss {step} vs {name}", loss_tol
                    )
                    worst[f"loss vs {name}"] = max(worst[f"loss vs {name}"], err)
        if set(adapters) != set(peft_adapters) or len(adapters) != 3 * N_LAYERS or set(ref_adapters) - set(adapters):
            raise AssertionError(f"{case}: adapters {sorted(adapters)[:3]}..., PEFT's {sorted(peft_adapters)[:3]}...")
        worst.update({"adapters vs PEFT under DeepSpeed": 0.0, "adapters vs PEFT in one process": 0.0})
        for name, want in peft_adapters.items():
            err = close(adapters[name], want, f"{case} {name} vs PEFT under DeepSpeed", ds_tol)
            worst["adapters vs PEFT under DeepSpeed"] = max(worst["adapters vs PEFT under DeepSpeed"], err)
            if name in ref_adapters:
                err = close(adapters[name], ref_adapters[name], f"{case} {name} vs PEFT in one process", one_tol)
                worst["adapters vs PEFT in one process"] = max(worst["adapters vs PEFT in one process"], err)
        print(f"worst relative errors, {case}: " + ", ".join(f"{k} {v:.2g}" for k, v in worst.items()), flush=True)
        print(f"OK {case}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    args = p.parse_args()
    if args.device == "cuda":
        dist_worker.DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dist_worker.DEVICE)
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        ref = reference(args.steps, batches(args.steps, 2 * world)) if rank == 0 else None
        for case in args.case:
            check(case, args.steps, ref)
    finally:
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
