"""Dropout masks on bitsandbytes bases are PEFT's: with the same seed, a run with flashdora draws the masks a run
without it draws (PEFT's bitsandbytes classes cast the input to the adapters' dtype before dropout without autocast,
and keep it as it is under autocast; flashdora does the same, in ``dropout="exact"`` mode)."""

import copy

import bitsandbytes as bnb
import pytest
import torch

import flashdora
from tests.peft_models import make_ids, train_step
from tests.qdora_models import qdora_model


def _bf16_qdora(peft_bnb, device):
    model = qdora_model("nf4", compute_dtype=torch.bfloat16, dropout=0.1, peft_bnb=peft_bnb, device=device)
    for name, p in model.named_parameters():
        if "lora_" not in name and p.dtype == torch.float32:
            p.data = p.data.to(torch.bfloat16)  # a bf16 model around its fp32 adapters, as PEFT leaves them
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.weight.quant_state.dtype = torch.bfloat16
            module.support_avx512bf16_for_cpu = False
    return model


def _masks(model, autocast, device):
    """Each dropout's input dtype and mask (zeros of its output where its input is not zero), in call order."""
    seen = []

    def record(module, args, out):
        seen.append((args[0].dtype, (out == 0) & (args[0] != 0)))

    handles = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    try:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            train_step(model, make_ids(256).to(device))
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("autocast", [False, True], ids=["no-autocast", "autocast"])
@pytest.mark.parametrize("peft_bnb", [False, True], ids=["peft-linear", "peft-bnb-class"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dropout_masks_on_a_4bit_base_are_pefts(device, peft_bnb, autocast, request):
    if device == "cuda" and peft_bnb and autocast:
        # PEFT's lora.bnb layers return float32 under CUDA autocast (the residual stream turns float32); flashdora
        # keeps the layer's dtype (docs/design.md), so later layers' dropout sees bf16 where PEFT's sees float32
        # (seen on an H200: the 5th dropout's input). README, "Dropout", says so.
        request.applymarker(pytest.mark.xfail(strict=True, reason="PEFT's float32 residual stream under autocast"))
    model = _bf16_qdora(peft_bnb, device)
    peft = copy.deepcopy(model)
    flashdora.enable(model)
    got, want = _masks(model, autocast, device), _masks(peft, autocast, device)
    assert len(got) == len(want) == 14
    assert [dtype for dtype, _ in got] == [dtype for dtype, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
