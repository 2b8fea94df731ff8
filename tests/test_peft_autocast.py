"""The PEFT seam under bf16 autocast with float32 adapters (HF Trainer's set-up): parity with PEFT, the skipped input
cast, and rounding where PEFT's autocast path rounds."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import flashdora
from tests.helpers import rel_err
from tests.peft_models import (  # noqa: F401 (unpatched: an autouse fixture)
    assert_grads_close,
    eval_logits,
    llama,
    make_ids,
    train_step,
    unpatched,
)


def test_autocast_bf16_parity():
    peft_model = llama(dropout=0.0)
    peft_model.base_model.model.to(torch.bfloat16)
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # PEFT's default: fp32 adapters on a bf16 model
    model = flashdora.enable(copy.deepcopy(peft_model))
    ids = make_ids(256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = eval_logits(model, ids)
        ref = eval_logits(peft_model, ids)
        loss, _, grads = train_step(model, ids)
        peft_loss, _, peft_grads = train_step(peft_model, ids)
    assert out.dtype == ref.dtype
    assert rel_err(out, ref) <= 2e-2 and rel_err(loss, peft_loss) <= 1e-2
    assert_grads_close(grads, peft_grads, rtol=5e-2)


def _bf16_model_fp32_adapters(dropout):
    peft_model = llama(dropout=dropout)
    peft_model.base_model.model.to(torch.bfloat16)
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return flashdora.enable(peft_model)


def _seen_lora_inputs(model, run):
    """The dtypes of ``x`` that flashdora's variant receives while ``run()`` runs."""
    from flashdora.peft import variant

    seen, original = [], variant.run_compose

    def spy(impl, result, lx, *args, **kwargs):
        seen.append(lx.dtype)
        return original(impl, result, lx, *args, **kwargs)

    variant.run_compose = spy
    try:
        run()
    finally:
        variant.run_compose = original
    return seen


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_input_cast_skip_is_bitwise_neutral(monkeypatch, dropout):
    """Under autocast, PEFT's cast of x to the fp32 adapters' dtype is skipped on flashdora layers without active
    dropout; outputs and every gradient stay bitwise equal to running with PEFT's cast."""
    from flashdora.peft import layers as peft_layers

    model = _bf16_model_fp32_adapters(dropout)
    ids = make_ids(256)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return eval_logits(model, ids), train_step(model, ids)

    seen = []
    fast = _seen_lora_inputs(model, lambda: seen.append(run()))
    with monkeypatch.context() as m:
        m.setattr(peft_layers.FlashDoraLinear, "_cast_input_dtype", peft_layers._PEFT_CAST)
        slow = _seen_lora_inputs(model, lambda: seen.append(run()))
    assert set(slow) == {torch.float32}
    n_eval = len(fast) // 2
    assert set(fast[:n_eval]) == {torch.bfloat16}  # eval: dropout inactive, so the cast is skipped
    assert set(fast[n_eval:]) == ({torch.bfloat16} if dropout == 0 else {torch.float32})
    (out, (loss, _, grads)), (ref, (ref_loss, _, ref_grads)) = seen
    assert torch.equal(out, ref) and torch.equal(loss, ref_loss)
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), name


def test_input_cast_kept_for_vanilla_lora_adapters():
    """A layer that also runs a plain LoRA adapter keeps PEFT's cast (its matmuls would otherwise see bf16 x)."""
    model = _bf16_model_fp32_adapters(0.0)
    model.add_adapter("plain", LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "plain"])
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    ids = make_ids(256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen = _seen_lora_inputs(model, lambda: eval_logits(model, ids))
    assert torch.float32 in seen and torch.bfloat16 in seen  # q_proj keeps the cast; the other layers skip it


@pytest.mark.parametrize(
    "device, backend",
    [("cpu", "eager"), ("cpu", "triton"), pytest.param("cuda", "triton", marks=pytest.mark.gpu, id="cuda-triton")],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("alpha, dropout", [(16, 0.0), (32, 0.0), (24, 0.1)], ids=["s1", "s2", "s1.5-dropout"])
def test_autocast_rounds_where_peft_rounds(monkeypatch, device, backend, bias, alpha, dropout):
    """Under bf16 autocast with fp32 adapters, flashdora rounds where PEFT's autocast path rounds (the LoRA output,
    ``result - bias``, the LoRA weight gradients), so it stays far closer to PEFT than either is to float64 and a
    model trained with it tracks PEFT's. (The LoRA tile kept in fp32 gave ~0.56 of that distance, 82% equal
    outputs.) What remains is the norm: PEFT's rounds ``B A`` to bf16, flashdora's never forms it, and, without
    dropout and with ``s`` not a power of two, one rounding of the LoRA weight gradients."""
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 96, bias=bias, dtype=torch.bfloat16, device=device))
    cfg = LoraConfig(
        r=16, lora_alpha=alpha, lora_dropout=dropout, use_dora=True, target_modules=["0"], init_lora_weights=False
    )
    peft_model = get_peft_model(net, cfg)
    with torch.no_grad():  # a trained-looking layer: s B A a fair share of W (same size for every s), m off the norm
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1 * 16 / alpha)
            if "magnitude" in name:
                p.mul_(1 + 0.05 * torch.randn_like(p))
    model = flashdora.enable(copy.deepcopy(peft_model))
    x = torch.randn(128, 256, dtype=torch.bfloat16, device=device)
    dy = torch.randn(128, 96, dtype=torch.bfloat16, device=device)
    runs = []
    for m, autocast in ((peft_model, True), (model, True), (copy.deepcopy(peft_model).double(), False)):
        torch.manual_seed(7)  # the same dropout mask in every run
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = m(x if autocast else x.double())
        y.backward(dy.to(y.dtype))
        grads = {n.split("lora_")[1].split(".")[0]: p.grad for n, p in m.named_parameters() if p.requires_grad}
        runs.append((y.detach(), grads))
    (y_peft, g_peft), (y, g), (y_64, g_64) = runs
    assert flashdora.stats()[backend] > 0
    assert y.dtype == y_peft.dtype == torch.bfloat16
    assert rel_err(y, y_peft) <= 0.35 * rel_err(y_peft, y_64) and (y == y_peft).float().mean() >= 0.97
    for name, share in (("A", 0.8), ("B", 0.65), ("magnitude_vector", 1.5)):
        assert g[name].dtype == g_peft[name].dtype == torch.float32
        assert rel_err(g[name], g_peft[name]) <= share * rel_err(g_peft[name], g_64[name]), name
