"""``flashdora parity --pretrain N``: a pretrained-like start for the training-curve comparison.

From random weights two bf16 trainings of the same model part chaotically, whatever computes them (the noise floor).
Fine-tuning, which the issue's curve bar comes from, starts from a trained model whose adapter is a small correction.
So: train the base first (all parameters), attach DoRA, and scale ``lora_B`` so that ``s B A`` is a small fraction
of ``W``, with each magnitude reset to ``||W + s B A||`` (PEFT's initialisation).
"""

from __future__ import annotations

import math

import torch
from peft.tuners.lora.layer import LoraLayer


def start_model(s: dict, seed: int, batches: list[torch.Tensor]) -> tuple[torch.nn.Module, dict]:
    """A seed's PEFT DoRA model for ``flashdora parity`` (settings ``s``): random, or with ``s["pretrain"]`` pretrained
    on ``batches`` first and ``lora_B`` scaled. Returns it and what to record beside the curves (the pretraining's
    first and last loss, the factor applied to ``lora_B``)."""
    from flashdora.tools import demo

    extra, prepare = {}, None
    if s["pretrain"]:

        def prepare(base):
            losses = pretrain_base(base, batches, s["pretrain_lr"], s["dtype"] == "autocast")
            extra["pretrain_loss"] = [losses[0], losses[-1]]

    model = demo.build_peft_model(s["size"], s["rank"], s["dropout"], s["device"], seed=seed, prepare=prepare)
    if s["pretrain"]:
        extra["lora_b_factor"] = scale_adapters(model, s["lora_b_ratio"])
    return model, extra


def pretrain_base(model: torch.nn.Module, batches: list[torch.Tensor], lr: float, autocast: bool) -> list[float]:
    """Next-token AdamW on every parameter of ``model`` over ``batches``; returns the losses.

    Warm-up over the first 5% of steps, then cosine decay to ``lr / 10``; gradient clipping at 1.0, weight decay
    0.01: a partly trained model, not a converged one.
    """
    params = [p for p in model.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    n, warm = len(batches), max(1, len(batches) // 20)

    def factor(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (i - warm) / max(1, n - warm)))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    losses = []
    for batch in batches:
        with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _dora_layers(model: torch.nn.Module):
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in module.lora_magnitude_vector:
                yield module, adapter


def _weight_and_delta(module: LoraLayer, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    weight = module.get_base_layer().weight.float()
    weight = weight.T if module.fan_in_fan_out else weight
    delta = module.scaling[adapter] * (module.lora_B[adapter].weight.float() @ module.lora_A[adapter].weight.float())
    return weight, delta


@torch.no_grad()
def scale_adapters(model: torch.nn.Module, ratio: float) -> float:
    """Scale every DoRA layer's ``lora_B`` by one factor so the median over all rows of ``||s B A|| / ||W||`` is
    ``ratio``; reset each magnitude to ``||W + s B A||`` (so ``g = 1``, as PEFT initialises it). Returns the factor.
    """
    if not ratio > 0:
        raise ValueError(f"scale_adapters: ratio expected > 0, got {ratio}")
    layers = list(_dora_layers(model))
    if not layers:
        raise ValueError("scale_adapters: the model has no DoRA layers")
    ratios = []
    for module, adapter in layers:
        weight, delta = _weight_and_delta(module, adapter)
        ratios.append(delta.norm(dim=1) / weight.norm(dim=1).clamp_min(1e-12))
    factor = ratio / torch.cat(ratios).median().item()
    for module, adapter in layers:
        module.lora_B[adapter].weight.mul_(factor)
        weight, delta = _weight_and_delta(module, adapter)
        magnitude = module.lora_magnitude_vector[adapter].weight
        magnitude.copy_((weight + delta).norm(dim=1).to(magnitude.dtype))
    return factor
