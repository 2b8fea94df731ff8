"""Nothing changes under a step: a checkpointed forward and its recomputation take the same route.

Gradient checkpointing (``use_reentrant=False``) checks that a recomputation saves the same tensors as the forward
did; a route chosen afresh on each call from state that changes in between (a bitsandbytes layer's first call, the
C++ extension becoming ready in the background) breaks that.
"""

import copy

import bitsandbytes as bnb
import pytest
import torch

import flashdora
from flashdora import dispatch, native
from flashdora.quant import base as bnb_base
from tests.peft_models import make_ids
from tests.qdora_models import int8_bf16_model, qdora_model


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _fresh_4bit(model):
    for layer in model.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            layer.compute_type_is_set = False  # as loaded: bitsandbytes sets it at the layer's first call
            layer.compute_dtype = None


def _int8_bases_in_eval(model):
    for layer in model.modules():
        if isinstance(layer, bnb.nn.Linear8bitLt):
            layer.eval()  # (bitsandbytes' CPU backend trains through another function; eval mode is CUDA's)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_first_step_of_a_fresh_qdora_model_under_checkpointing(kind, reentrant, monkeypatch):
    """A fresh QDoRA model's first training step under gradient checkpointing runs (the shortcut's first-call rules
    used to switch routes between the forward and its recomputation), and its loss and gradients equal PEFT's
    (without checkpointing: bitsandbytes' own 8-bit layer fails its recomputation on the CPU)."""
    monkeypatch.setattr(bnb_base, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(bnb_base, "_ROWS", {})
    model = qdora_model() if kind == "nf4" else int8_bf16_model()
    _fresh_4bit(model)
    peft = copy.deepcopy(model)
    flashdora.enable(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    prepare = _int8_bases_in_eval if kind == "int8" else (lambda m: None)
    flashdora.reset_stats()
    for step in range(2):
        ids = make_ids(256, step)
        twin = copy.deepcopy(peft)  # (a fresh one each step: bitsandbytes' own 8-bit layer fails its second CPU step)
        for m in (model, twin):
            m.train()
            prepare(m)
        loss, grads = _step(model, ids)
        want_loss, want_grads = _step(twin, ids)
        tol = 2e-2 if kind == "int8" else 1e-4  # (int8: a bf16 model)
        assert abs(loss - want_loss) <= tol * abs(want_loss)
        for name, want in want_grads.items():
            assert (grads[name] - want).norm() <= tol * want.norm() + 1e-6, name
    assert flashdora.stats().get("base:4bit" if kind == "nf4" else "base:8bit", 0) > 0


class _Built:
    """A stand-in for the built extension (the adoption rules are what is tested)."""


@pytest.fixture
def built(monkeypatch):
    native.reset()
    monkeypatch.setattr(native, "_module", _Built())
    monkeypatch.setattr(native, "_state", "ready")
    yield native._module
    native.reset()


def test_a_build_that_ends_mid_step_waits_for_an_optimizer_step(built):
    """A build that has ended is not used by a layer call with grad (a forward awaiting its backward may have run
    the Python path); the next optimizer step adopts it."""
    native._watch_steps()
    assert native.module(wait=False) is None
    assert not dispatch.native_ready()  # a call with grad: still the Python path
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    torch.optim.SGD([param], lr=0.1).step()
    assert native.module(wait=False) is built and dispatch.native_ready() and native._adopted is built


def test_a_call_without_grad_adopts_a_finished_build(built):
    """Inference (and reentrant checkpointing's first forward) records nothing for a backward: a call without grad
    adopts a finished build."""
    with torch.no_grad():
        assert dispatch.native_ready() and native._adopted is built
    assert native.module(wait=False) is built


def test_waiting_for_the_build_adopts_it(built):
    assert native.module(wait=True) is built


def test_switched_off_never_adopts(built, monkeypatch):
    monkeypatch.setenv("FLASHDORA_NATIVE", "0")
    native.adopt()
    with torch.no_grad():
        native.adopt_without_grad()
    assert native._adopted is None
