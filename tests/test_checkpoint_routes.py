"""Nothing changes under a step: a checkpointed forward and its recomputation take the same route.

Gradient checkpointing (``use_reentrant=False``) checks that a recomputation saves the same tensors as the forward
did; a route chosen afresh on each call from state that changes in between (a bitsandbytes layer's first call, the
C++ extension switched with ``configure`` between a forward and its backward) breaks that.
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
    """A stand-in for the loaded extension (the decision is what is tested)."""


class _CudaLike:
    is_cuda = True


def test_native_is_decided_once_per_call_and_a_recomputation_keeps_its_forwards_answer(monkeypatch):
    """``configure(native=...)`` between a forward and its backward: a call inside the backward (a checkpoint's
    recomputation) takes the answer its layer's forward took; the next call outside a backward takes the new one."""
    monkeypatch.setattr(native.build, "_module", _Built())
    layer, x, seen = torch.nn.Linear(2, 2), _CudaLike(), []
    assert dispatch.native_for(layer, x)

    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(dispatch.native_for(layer, x))  # inside the backward
            return g

    t = torch.ones(2, requires_grad=True)
    y = Recompute.apply(t)
    with flashdora.config.override(native=False):
        y.sum().backward()
        assert seen == [True]
        assert not dispatch.native_for(layer, x)  # outside a backward: the new setting
        Recompute.apply(t).sum().backward()
        assert seen == [True, False]  # latched anew
    assert dispatch.native_for(layer, x)


@pytest.mark.parametrize("trains", ["grad", "training-mode", "inference"])
def test_only_a_call_that_trains_builds_the_extension(monkeypatch, trains):
    """A training call (grad on; or the layer in training mode, as reentrant checkpointing's first forward runs
    without grad) builds the extension where the cache lacks it; inference only loads a finished build."""
    asked = []
    monkeypatch.setattr(native.build, "_module", None)
    monkeypatch.setattr(native.build, "load", lambda build=True: asked.append(build))
    layer = torch.nn.Linear(2, 2).train(trains == "training-mode")
    with torch.set_grad_enabled(trains == "grad"):
        assert not dispatch.native_for(layer, _CudaLike())  # (the stand-in load gives nothing)
    assert asked == [trains != "inference"]


@pytest.mark.gpu
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["bf16", "nf4", "int8"])
def test_gpu_configure_native_between_a_forward_and_its_backward(kind, reentrant):
    """``configure(native=...)`` switched between a checkpointed forward and its backward, both ways, on 16-bit,
    nf4 and int8 bases: the recomputation takes its forward's route (no ``CheckpointError``: "73 tensors saved in
    the forward, 66 in the recomputation" on nf4 before), and every step's loss and gradients are PEFT's."""
    from tests.fresh_worker import build as build_model
    from tests.fresh_worker import step as train_step

    model = build_model(kind)
    twin = copy.deepcopy(model)
    flashdora.enable(model)
    for m in (model, twin):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.enable_input_require_grads()
        m.train()
    flashdora.reset_stats()
    for n, native_after in enumerate([False, True, False, True]):
        ids = torch.randint(0, 256, (1, 1024 + 64 * n), generator=torch.Generator().manual_seed(n)).cuda()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        with flashdora.config.override(native=native_after):  # between the forward and its backward
            loss.backward()
        grads = {k: p.grad.float() for k, p in model.named_parameters() if p.requires_grad}
        want_loss, want = train_step(twin, ids)
        assert abs(loss.float() - want_loss) <= 5e-3 * abs(want_loss), n
        for k, w in want.items():
            assert (grads[k] - w).norm() <= 5e-2 * w.norm() + 1e-6, (n, k)
        flashdora.configure(native=native_after)  # the next step's forward: the other route
    flashdora.configure(native=True)
    assert flashdora.stats().get("native_backward", 0) > 0
