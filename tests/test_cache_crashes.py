"""Crashes reported against flashdora's norm cache, one deterministic test each.

Norms cached under ``inference_mode``, ``torch.func`` transforms, ``model.to('meta')``, pickling with DoRA embeddings,
double backward, ``swap_tensors`` after a forward: each runs and, where numbers come out, matches PEFT (through the
twin harness of tests/cache_helpers.py, or a PEFT copy of a small MLP). The routes by which weights change, and the
cache must follow, are in tests/test_cache_routes.py.
"""

import copy
import io
import random

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import flashdora
from flashdora.reference import dora_linear_ref
from tests.cache_helpers import GRAD_RTOL, Pair, _check, _forward, _llama, _owners, _pair
from tests.helpers import dora_inputs, rel_err
from tests.peft_models import unpatched  # noqa: F401 - the autouse fixture: PEFT runs its own code here
from tests.test_cache_routes import _take


@pytest.mark.parametrize("then", ["adamw-loop", "merge-unmerge", "load_state_dict", "mul_-lora_B"])
def test_inference_mode_forward_then(then, monkeypatch):
    """Norms cached under ``torch.inference_mode()`` are inference tensors: a later training step (they would be
    saved for backward), a merge, a load or an in-place edit must still work and match PEFT."""
    pair = _pair("llama", 0, monkeypatch)
    _check(pair, "first forward", "inference_mode")
    _take(pair, then)
    _check(pair, f"after {then}", "train")
    _check(pair, f"after {then}", "no_grad")


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(12, 20)
        self.down = nn.Linear(20, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mlp_pair(dtype=torch.float32):
    """A two-layer MLP with DoRA on both layers: enabled, and its PEFT twin."""
    torch.manual_seed(0)
    lora = LoraConfig(r=3, lora_alpha=6, use_dora=True, target_modules=["up", "down"], init_lora_weights=False)
    model = get_peft_model(_MLP().to(dtype), lora)
    twin = copy.deepcopy(model)
    return flashdora.enable(model), twin


def _lora_params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp"])
def test_torch_func_over_lora_parameters(transform, backend, monkeypatch):
    """``torch.func`` transforms of a function of the LoRA parameters run (flashdora may hand them to PEFT's code)
    and give PEFT's numbers."""
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    model, twin = _mlp_pair()
    x = torch.randn(4, 12)
    params = _lora_params(model)
    model(x)  # a cache entry for the real parameters exists

    def run(m):
        if transform == "grad":
            f = lambda ps: torch.func.functional_call(m, ps, (x,)).square().sum()  # noqa: E731
            return torch.func.grad(f)(params)
        if transform == "vmap":
            name = "base_model.model.up.lora_B.default.weight"
            stacked = torch.stack([params[name] * k for k in (0.5, 1.0, 2.0)])
            return {"out": torch.func.vmap(lambda b: torch.func.functional_call(m, {name: b}, (x,)))(stacked)}
        tangents = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, (n, p) in
                    enumerate(params.items())}  # fmt: skip
        out, tangent = torch.func.jvp(lambda ps: torch.func.functional_call(m, ps, (x,)), (params,), (tangents,))
        return {"out": out, "tangent": tangent}

    peft_out = run(twin)
    out = run(model)
    assert out.keys() == peft_out.keys()
    for name, ref in peft_out.items():
        assert rel_err(out[name], ref) <= GRAD_RTOL, f"{transform}: {name} relative error {rel_err(out[name], ref)}"


@pytest.mark.parametrize("grad", [True, False])
def test_meta_forward(grad):
    """``model.to('meta')`` after a forward (the cache holds CPU norms): a forward on meta inputs gives meta outputs
    of PEFT's shape."""
    model, twin = _mlp_pair()
    x = torch.randn(4, 12)
    model(x)
    with torch.set_grad_enabled(grad):
        twin.to("meta")
        peft_out = twin(x.to("meta"))
        model.to("meta")
        out = model(x.to("meta"))
    assert out.is_meta and out.shape == peft_out.shape == (4, 8)


def test_pickle_a_model_with_dora_embeddings(monkeypatch):
    """``torch.save`` of an enabled model whose DoRA Embedding layers run PEFT's code (behind flashdora's counting
    variant), after training and eval forwards; the loaded model runs and matches PEFT."""
    model = _llama(0, small=False, targets=["q_proj", "v_proj", "embed_tokens"])
    twin = copy.deepcopy(model)
    flashdora.enable(model)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    for m in (model, twin):
        _forward(m, ids, "train", 0)
        _forward(m, ids, "no_grad", 0)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    pair = Pair(loaded, twin, 256, None, random.Random(0), monkeypatch)
    for mode in ("no_grad", "train", "inference_mode"):
        _check(pair, "loaded", mode, ids=ids)


def _second_order(fn, inputs, loss):
    """First-order gradients of ``loss(fn(*inputs))`` (with ``create_graph``) and the gradients of a weighted sum of
    those, as a gradient penalty or a Hessian-vector product takes them."""
    g = torch.Generator().manual_seed(0)
    y = fn(*inputs)
    w = torch.randn(y.shape, generator=g, dtype=y.dtype)
    out = (y * w).sum() if loss == "weighted-sum" else (y * w).square().sum()
    first = torch.autograd.grad(out, inputs, create_graph=True)
    hv = sum((d * torch.randn(d.shape, generator=g, dtype=d.dtype)).sum() for d in first)
    second = torch.autograd.grad(hv, inputs, allow_unused=True, materialize_grads=True)
    return [d.detach() for d in first] + list(second)


@pytest.mark.parametrize("opt_in", [False, True], ids=["default", "double_backward"])
@pytest.mark.parametrize("loss", ["weighted-sum", "squared"])  # the output's gradient a constant, or not
@pytest.mark.parametrize("where", ["dora_linear", "layer"])
def test_double_backward_raises_or_matches_peft(where, loss, opt_in):
    """Double backward: a RuntimeError is an honest answer; numbers other than PEFT's never are (float64 inputs).
    Under ``flashdora.double_backward()`` only PEFT's numbers are."""
    if where == "dora_linear":
        args = {k: v.double() if torch.is_tensor(v) else v for k, v in dora_inputs(6, 5, 3, lead=(2, 3)).items()}
        inputs = [args[k].requires_grad_() for k in ("x", "lora_A", "lora_B", "magnitude")]
        weight, bias, s = args["weight"], args["bias"], args["scaling"]
        out_fn = lambda x, a, b, m: flashdora.dora_linear(x, weight, bias, a, b, m, s)  # noqa: E731
        ref_fn = lambda x, a, b, m: dora_linear_ref(x, weight, bias, a, b, m, s)  # noqa: E731
    else:
        model, twin = _mlp_pair(torch.float64)
        names = [f"{n}.default.weight" for n in ("lora_A", "lora_B", "lora_magnitude_vector")]
        layers = [m.base_model.model.up for m in (model, twin)]

        def through(layer):
            return lambda x, *ps: torch.func.functional_call(layer, dict(zip(names, ps)), (x,))

        out_fn, ref_fn = through(layers[0]), through(layers[1])
        x = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
        inputs = [x] + [layers[0].get_parameter(n).detach().clone().requires_grad_() for n in names]
    ref = _second_order(ref_fn, inputs, loss)
    try:
        with flashdora.double_backward(opt_in):
            out = _second_order(out_fn, inputs, loss)
    except RuntimeError:
        if opt_in:
            raise
        return
    labels = [f"{order} d/d{name}" for order in ("first", "second") for name in ("x", "lora_A", "lora_B", "magnitude")]
    for label, o, r in zip(labels, out, ref):
        assert rel_err(o, r) <= 1e-9, f"{where}: {label} relative error {rel_err(o, r):.1e}"


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_swap_tensors_after_a_forward(backend, monkeypatch):
    """``torch.utils.swap_tensors`` refuses tensors with weak references: the cache (also what the Triton path keeps
    across optimizer steps) must hold none to a layer's base weight, lora_B or magnitude."""
    pair = _pair("gpt2", 0, monkeypatch, backend)
    _take(pair, "adamw-loop")
    _check(pair, "first forward", "train")
    _check(pair, "first forward", "no_grad")
    for kind in ("base", "lora_B", "magnitude"):
        owners = _owners(pair, kind)
        old = getattr(*owners[0])
        new = old.detach() * 1.3
        for module, attr in owners:
            torch.utils.swap_tensors(getattr(module, attr), nn.Parameter(new.clone(), requires_grad=old.requires_grad))
    _check(pair, "after swapping", "train")
    _check(pair, "after swapping", "no_grad")
