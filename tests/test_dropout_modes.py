"""``enable(model, dropout=...)``: PEFT's exact dropout function (default) and the opt-in ``"adapter"`` mode."""

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn

import flashdora
from tests.peft_models import llama, make_ids, unpatched  # noqa: F401 (fixture)


def _layer(dtype=torch.float64, dropout=0.3, seed=0):
    """One PEFT DoRA Linear layer (with a bias) in a small module, its lora_B non-zero."""
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(24, 40, bias=True)).to(dtype)
    config = LoraConfig(r=6, lora_alpha=9, lora_dropout=dropout, use_dora=True, target_modules=["0"])
    model = get_peft_model(base, config)
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.3)
        layer.lora_magnitude_vector["default"].weight.mul_(1.3)
    return model.to(dtype), layer


def _adapter_reference(layer, x, lx):
    """``y = g (x W^T + s (lx A^T) B^T) + b`` with ``g = m / ||W + s B A||`` (the norm detached), plain float64."""
    w, b = layer.base_layer.weight, layer.base_layer.bias
    a, bb = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    m, s = layer.lora_magnitude_vector["default"].weight, layer.scaling["default"]
    norm = torch.linalg.vector_norm(w + s * (bb @ a), dim=1).detach()
    return (m / norm) * (F.linear(x, w) + s * F.linear(F.linear(lx, a), bb)) + b


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_adapter_mode_trains_its_formula(backend, monkeypatch):
    """Training forward and every gradient against the float64 formula, with the same dropout mask (eager: float64
    end to end; Triton (interpreter): float32 kernels against the float64 formula)."""
    dtype = torch.float64 if backend == "eager" else torch.float32
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    model, layer = _layer(dtype)
    flashdora.enable(model, dropout="adapter")
    model.train()
    x = torch.randn(3, 5, 24, dtype=dtype, requires_grad=True)
    torch.manual_seed(7)
    out = model(x)
    torch.manual_seed(7)
    lx = layer.lora_dropout["default"](x)  # the same mask: the base layer draws no random numbers
    ref_model = copy.deepcopy(model).double()
    ref_layer = ref_model.base_model.model[0]
    x64 = x.detach().double().requires_grad_()
    keep = (lx.detach() != 0).double()  # the mask (x is never exactly 0), as a function of x64 for its gradient
    ref = _adapter_reference(ref_layer, x64, x64 * keep / (1 - 0.3))
    dy = torch.randn_like(ref)
    out.backward(dy.to(dtype))
    ref.backward(dy)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    assert (out.double() - ref).abs().max() / ref.abs().max() < tol
    for name in ("lora_A", "lora_B", "lora_magnitude_vector"):
        got = getattr(layer, name)["default"].weight.grad
        want = getattr(ref_layer, name)["default"].weight.grad
        assert got is not None and (got.double() - want).abs().max() / want.abs().max() < tol, name
    assert (x.grad.double() - x64.grad).abs().max() / x64.grad.abs().max() < tol
    assert flashdora.stats().get("peft_fallback:torch.func") is None


def test_adapter_mode_evaluates_as_peft():
    """In eval the dropout is off, so the adapter mode is PEFT's function: the same output as PEFT's own DoRA."""
    model, _ = _layer(torch.float32)
    twin = copy.deepcopy(model)
    flashdora.enable(model, dropout="adapter")
    x = torch.randn(4, 24)
    model.eval()
    twin.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), twin(x), rtol=1e-5, atol=1e-6)


def test_adapter_mode_differs_from_exact_in_training():
    """The two modes train different functions (a test that could not fail otherwise): same mask, other output."""
    outs = []
    for mode in ("exact", "adapter"):
        model, _ = _layer(torch.float64)
        flashdora.enable(model, dropout=mode)
        model.train()
        torch.manual_seed(3)
        outs.append(model(torch.randn(2, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))))
    assert (outs[0] - outs[1]).abs().max() > 1e-3


def test_adapter_mode_under_autocast_drops_out_the_16bit_input():
    """Under autocast with float32 adapters PEFT casts a bf16 input to float32 before its dropout (and autocast casts
    it back for the matmul); the adapter mode keeps the bf16 input (no round trip), the exact form keeps PEFT's cast.
    The output is the adapter formula's with the mask the dropout drew."""
    seen = {}
    for mode in ("exact", "adapter"):
        model, layer = _layer(torch.float32)
        flashdora.enable(model, dropout=mode)
        model.train()
        drop = layer.lora_dropout["default"]
        drop.register_forward_hook(lambda mod, args, out, mode=mode: seen.update({mode: (args[0].dtype, out)}))
        x = torch.randn(3, 5, 24).bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert seen["exact"][0] == torch.float32 and seen["adapter"][0] == torch.bfloat16
    lx = seen["adapter"][1]
    ref = _adapter_reference(copy.deepcopy(layer).double(), x.double(), lx.double())
    assert (out.double() - ref).abs().max() / ref.abs().max() < 3e-2  # (bf16 matmuls under autocast)


def test_exact_mode_is_peft_in_training():
    """The default keeps PEFT's function with dropout: the same output and gradients as PEFT's DoRA, same masks."""
    model = llama(dropout=0.2)
    twin = copy.deepcopy(model)
    flashdora.enable(model)
    ids = make_ids(256)
    results = []
    for m in (model, twin):
        m.train()
        torch.manual_seed(11)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for name, grad in results[1][1].items():
        torch.testing.assert_close(results[0][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_patch_peft_takes_a_mode_and_enable_overrides_it():
    model, layer = _layer(torch.float64)
    flashdora.patch_peft(dropout="adapter")
    assert flashdora.peft.variant._patch_dropout == "adapter"
    flashdora.enable(model)  # the model's own mode: exact
    assert layer.__dict__["_flashdora_dropout"] == "exact"
    flashdora.unpatch_peft()
    assert flashdora.peft.variant._patch_dropout == "exact"


@pytest.mark.parametrize("call", ["enable", "patch_peft"])
def test_unknown_dropout_mode_is_a_named_error(call):
    model, _ = _layer(torch.float32)
    with pytest.raises(ValueError, match=rf"{call}: dropout expected one of 'exact', 'adapter', got 'Adapter'"):
        flashdora.enable(model, dropout="Adapter") if call == "enable" else flashdora.patch_peft(dropout="Adapter")
