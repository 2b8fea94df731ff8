"""Gradients of gradients (``create_graph=True``) through flashdora's DoRA: PEFT's second order under
``flashdora.double_backward()``, a clear refusal without it, and first-order forwards that save what they saved before.

A gradient penalty ``||grad||^2`` over a PEFT DoRA model's gradients (LoRA parameters, magnitude, input, trainable
biases) differentiates every first-order gradient again, the magnitude's ``sum dy * inner / norm`` included: its
second-order terms reach the base output's producers through ``inner`` (ops/compose_grad2.py)."""

import copy
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import flashdora
from flashdora.ops import compose as C
from flashdora.ops import compose_grad2
from flashdora.reference import dora_linear_ref
from tests.helpers import dora_inputs, rel_err
from tests.peft_models import unpatched  # noqa: F401 (fixture)


class _MLP(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.up, self.down = nn.Linear(12, 16, bias=bias), nn.Linear(16, 8, bias=bias)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _peft_pair(dtype, bias=True, dropout=0.0, lora_bias="none", device="cpu"):
    """A two-layer PEFT DoRA MLP (random lora_B), and its twin with the same weights; ``lora_bias="all"`` trains the
    base biases too."""
    torch.manual_seed(0)
    lora = LoraConfig(r=3, lora_alpha=6, lora_dropout=dropout, use_dora=True, target_modules=["up", "down"],
                      init_lora_weights=False, bias=lora_bias)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(_MLP(bias).to(device=device, dtype=dtype), lora)
    return model, copy.deepcopy(model)


def _penalty_grads(model, x, seed=0, autocast=None):
    """First-order gradients (``create_graph``) of a loss over the trainable parameters and the input, then the
    gradients of ``sum ||grad||^2`` (a gradient penalty): the first-order values and the second-order ones."""
    params = [p for p in model.parameters() if p.requires_grad]
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)  # (the same dropout masks on both models)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast is not None):
        loss = model(x).float().square().mean()
    first = torch.autograd.grad(loss, [x, *params], create_graph=True)
    penalty = sum(g.float().square().sum() for g in first)
    second = torch.autograd.grad(penalty, [x, *params])
    return [g.detach() for g in first], list(second)


def _assert_matches(got, want, rtol):
    for order, gs, ws in zip(("first", "second"), got, want, strict=True):
        for i, (g, w) in enumerate(zip(gs, ws, strict=True)):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert rel_err(g, w) <= rtol, f"{order}-order gradient {i}: relative error {rel_err(g, w):.2e}"


_CASES = [
    pytest.param(torch.float64, "eager", True, 0.0, "none", id="f64-eager"),
    pytest.param(torch.float64, "eager", False, 0.0, "none", id="f64-eager-nobias"),
    pytest.param(torch.float64, "eager", True, 0.0, "all", id="f64-eager-trained-bias"),
    pytest.param(torch.float64, "eager", True, 0.2, "none", id="f64-eager-dropout"),
    pytest.param(torch.float32, "eager", True, 0.2, "all", id="f32-eager-dropout-trained-bias"),
    pytest.param(torch.float32, "triton", True, 0.0, "none", id="f32-triton"),
    pytest.param(torch.float32, "triton", False, 0.2, "none", id="f32-triton-dropout-nobias"),
    pytest.param(torch.float32, "triton", True, 0.0, "all", id="f32-triton-trained-bias"),
]


@pytest.mark.parametrize(("dtype", "backend", "bias", "dropout", "lora_bias"), _CASES)
def test_gradient_penalty_matches_peft(dtype, backend, bias, dropout, lora_bias, monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    model, twin = _peft_pair(dtype, bias, dropout, lora_bias)
    flashdora.enable(model)
    flashdora.reset_stats()
    x = torch.randn(2, 5, 12, dtype=dtype)
    with flashdora.double_backward():
        got = _penalty_grads(model, x)
    _assert_matches(got, _penalty_grads(twin, x), 1e-10 if dtype == torch.float64 else 2e-5)
    assert flashdora.stats().get(backend if backend == "eager" else "triton", 0) > 0


def test_dropout_in_the_adapter_only_mode(monkeypatch):
    """``dropout="adapter"`` (the low-rank branch only): the compose's own function, differentiated twice, against
    ``dora_linear_ref`` with that function's ``lora_x`` as ``x`` for the branch (float64)."""
    args = {k: v.double() if torch.is_tensor(v) else v for k, v in dora_inputs(6, 5, 3, lead=(2, 3)).items()}
    x = args["x"].requires_grad_()
    ps = [args[k].requires_grad_() for k in ("lora_A", "lora_B", "magnitude")]
    w, b, s = args["weight"], args["bias"], args["scaling"]
    mask = (torch.rand_like(x) > 0.3).double() / 0.7

    def run(fn):
        lx = x * mask
        result = torch.nn.functional.linear(x, w, b)
        first = torch.autograd.grad(fn(result, lx).square().sum(), [x, *ps], create_graph=True)
        return [g.detach() for g in first], list(torch.autograd.grad(sum(g.square().sum() for g in first), [x, *ps]))

    def ours(result, lx):
        from flashdora.ops.norm import fresh

        scales = fresh(w, ps[0].detach(), ps[1].detach(), ps[2].detach(), s, "eager")[1]
        return C.compose(result, lx, *ps, scales, s, bias=b)

    def ref(result, lx):  # y = g (result - b + s lx A^T B^T) + b
        g = ps[2] / (w + s * ps[1] @ ps[0]).norm(dim=1).detach()
        return g * (result - b + s * (lx @ ps[0].T) @ ps[1].T) + b

    with flashdora.double_backward():
        got = run(ours)
    _assert_matches(got, run(ref), 1e-10)


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "lora_x"])
def test_dora_linear_gradgradcheck_and_hessian(dropout):
    """``flashdora.dora_linear`` in float64: ``gradcheck`` and ``gradgradcheck`` in ``x``, ``bias`` and ``magnitude``
    (the norm depends on the weight and the LoRA factors, and is a constant to autograd, in PEFT too: numerical
    derivatives in those would see it move), and the whole Hessian, every input, against ``dora_linear_ref``'s."""
    args = {k: v.double() if torch.is_tensor(v) else v for k, v in dora_inputs(5, 4, 2, lead=(3,)).items()}
    names = ["x", "weight", "bias", "lora_A", "lora_B", "magnitude"]
    inputs = [args[k].clone().requires_grad_() for k in names]
    mask = (torch.rand_like(args["x"]) > 0.3).double() / 0.7

    def fn(x, weight, bias, lora_A, lora_B, magnitude):
        lora_x = x * mask if dropout else None
        return flashdora.dora_linear(x, weight, bias, lora_A, lora_B, magnitude, 0.7, lora_x=lora_x)

    def ref(x, weight, bias, lora_A, lora_B, magnitude):
        return dora_linear_ref(x, weight, bias, lora_A, lora_B, magnitude, 0.7, x * mask if dropout else None)

    x, weight, bias, lora_A, lora_B, magnitude = inputs
    part = lambda x, bias, magnitude: fn(x, weight, bias, lora_A, lora_B, magnitude)  # noqa: E731
    with flashdora.double_backward():
        assert torch.autograd.gradcheck(part, (x, bias, magnitude))
        assert torch.autograd.gradgradcheck(part, (x, bias, magnitude))
        got = torch.autograd.functional.hessian(lambda *ins: fn(*ins).square().sum(), tuple(inputs))
    want = torch.autograd.functional.hessian(lambda *ins: ref(*ins).square().sum(), tuple(inputs))
    for i, row in enumerate(got):
        for j, h in enumerate(row):
            assert rel_err(h, want[i][j]) <= 1e-10, (names[i], names[j], rel_err(h, want[i][j]))


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_without_double_backward_create_graph_is_refused(backend, monkeypatch):
    """A forward run with ``double_backward`` off refuses ``create_graph=True`` with a message naming the switch;
    the switch counts at the forward (a context manager restores the previous setting)."""
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    model, _ = _peft_pair(torch.float32)
    flashdora.enable(model)
    x = torch.randn(2, 5, 12)
    with pytest.raises(RuntimeError, match=r"flashdora.double_backward\(\)"):
        _penalty_grads(model, x)
    with flashdora.double_backward(True):
        assert compose_grad2.enabled()
        with flashdora.double_backward(False):
            assert not compose_grad2.enabled()
            y = model(x)
        assert compose_grad2.enabled()
    assert not compose_grad2.enabled()
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(RuntimeError, match="double_backward"):
        torch.autograd.grad(y.square().sum(), params, create_graph=True)
    flashdora.double_backward()
    try:
        assert compose_grad2.enabled()
        _penalty_grads(model, x)  # a forward with it on: runs
    finally:
        flashdora.double_backward(False)
    assert not compose_grad2.enabled()


def _saved(fn):
    """``(shape, dtype, bytes)`` of each tensor the forward ``fn()`` saves for backward."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_first_order_forward_saves_what_it_saved_before(backend, monkeypatch):
    """First-order training pays nothing for second order: one layer call saves the base matmul's ``W^T``, the LoRA
    A matmul's ``A^T`` and ``x``, then the compose's ``a`` and ``inner``, nothing more (the tensors this test was
    written against). A forward under ``double_backward`` saves the same tensors (its cost is one more output)."""
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    args = dora_inputs(6, 5, 3, lead=(2, 4))
    args["x"].requires_grad_()
    for k in ("lora_A", "lora_B", "magnitude"):
        args[k].requires_grad_()
    call = lambda: flashdora.dora_linear(**args)  # noqa: E731
    f32 = torch.float32
    want = [((6, 5), f32, 120), ((6, 3), f32, 72), ((8, 6), f32, 192), ((2, 4, 3), f32, 96), ((2, 4, 5), f32, 160)]
    assert _saved(call) == want
    with flashdora.double_backward():
        assert _saved(call) == want


def test_bitsandbytes_4bit_base_matches_peft(monkeypatch):
    """A QDoRA model (nf4 bases, bitsandbytes on the CPU): flashdora's base Function (``quant.base._Linear4bit``)
    and the compose, differentiated twice, give PEFT + bitsandbytes' second order."""
    pytest.importorskip("bitsandbytes")
    from flashdora.quant import base as bnb_base
    from tests.qdora_models import qdora_model

    monkeypatch.setattr(bnb_base, "DEVICES", ("cuda", "cpu"))
    model = qdora_model("nf4")
    model.config._attn_implementation = "eager"  # (SDPA's CPU kernel has no double backward)
    twin = copy.deepcopy(model)
    flashdora.enable(model)
    emb = torch.randn(1, 6, 64)

    def grads(m):
        params = [p for p in m.parameters() if p.requires_grad]
        x = emb.clone().requires_grad_()
        loss = m(inputs_embeds=x).logits.float().square().mean()
        first = torch.autograd.grad(loss, [x, *params], create_graph=True)
        return [g.detach() for g in first], list(torch.autograd.grad(sum(g.square().sum() for g in first), params))

    with flashdora.double_backward():
        got = grads(model)
    assert flashdora.stats().get("base:4bit", 0) > 0
    _assert_matches(got, grads(twin), 1e-4)


# ---- GPU: bf16 autocast and fp32 against PEFT, the Triton path; the C++ node refuses, the opt-in skips it ----


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["plain", "dropout"])
def test_gpu_gradient_penalty_matches_peft(autocast, dropout):
    model, twin = _peft_pair(torch.float32, True, dropout, device="cuda")
    flashdora.enable(model)
    x = torch.randn(4, 64, 12, device="cuda")
    flashdora.reset_stats()
    with flashdora.double_backward():
        got = _penalty_grads(model, x, autocast=autocast)
    assert flashdora.stats().get("triton", 0) > 0 and flashdora.stats().get("native_backward", 0) == 0
    _assert_matches(got, _penalty_grads(twin, x, autocast=autocast), 1e-4 if autocast is None else 5e-2)


@pytest.mark.gpu
def test_gpu_cpp_node_refuses_create_graph_and_the_opt_in_avoids_it(monkeypatch):
    """The C++ compose and layer nodes (the default CUDA training path once built) refuse ``create_graph=True`` with
    the Python path's message; under ``double_backward`` the forward runs ``ComposeGrad2`` instead, and matches
    PEFT."""
    from flashdora import native

    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    if native.load() is None:
        pytest.skip("the C++ extension cannot be built here")
    model, twin = _peft_pair(torch.float32, False, 0.0, device="cuda")
    flashdora.enable(model)
    x = torch.randn(4, 64, 12, device="cuda")
    for _ in range(3):  # compiles and files the kernels' plans: the C++ path takes later calls
        model(x).square().mean().backward()
    model.zero_grad()
    y = model(x)
    assert y.grad_fn.name() in ("FlashDoraComposeBackward", "FlashDoraLayerBackward")  # (a plain base: the layer's)
    with pytest.raises(RuntimeError, match=r"flashdora.double_backward\(\)"):
        torch.autograd.grad(y.square().mean(), [p for p in model.parameters() if p.requires_grad], create_graph=True)
    with flashdora.double_backward():
        got = _penalty_grads(model, x)
    _assert_matches(got, _penalty_grads(twin, x), 1e-4)


def test_third_order_with_a_frozen_magnitude():
    """A frozen magnitude (``inner`` neither saved nor returned) and a third backward: ``dora_linear_ref``'s."""
    args = {k: v.double() if torch.is_tensor(v) else v for k, v in dora_inputs(6, 5, 3, lead=(2, 3)).items()}
    ins = [args[k].requires_grad_() for k in ("x", "lora_A", "lora_B")]

    def run(fn):
        y = fn(ins[0], args["weight"], args["bias"], ins[1], ins[2], args["magnitude"], 0.7)
        g = torch.autograd.grad(y.square().sum(), ins, create_graph=True)
        h = torch.autograd.grad(sum(t.square().sum() for t in g), ins, create_graph=True)
        return [*g, *h, *torch.autograd.grad(sum(t.square().sum() for t in h), ins)]

    with flashdora.double_backward():
        got = run(flashdora.dora_linear)
    for i, (g, w) in enumerate(zip(got, run(dora_linear_ref), strict=True)):
        assert rel_err(g, w) <= 1e-10, i
