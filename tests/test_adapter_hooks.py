"""Hooks on the adapter modules are honoured: PEFT calls ``lora_A``, ``lora_B`` and the magnitude module, so a layer
whose modules carry a hook runs PEFT's own forward, counted (``peft_fallback:hooks:<module>``) and warned once."""

import copy

import pytest
import torch

import flashdora
from flashdora import backend
from tests.helpers import rel_err
from tests.peft_models import llama, make_ids, train_step

# (the first DoRA layer of the tiny Llama; each case hooks one of its modules)
LAYER = "base_model.model.model.layers.0.self_attn.q_proj"


def _modules(model):
    layer = model.get_submodule(LAYER)
    return {"lora_A": layer.lora_A["default"], "lora_B": layer.lora_B["default"],
            "magnitude": layer.lora_magnitude_vector["default"]}  # fmt: skip


def _twins():
    model = llama(dropout=0.0)
    peft = copy.deepcopy(model)
    flashdora.enable(model)
    return model, peft


def _double(module, args, output):
    return output * 2


def _pre_scale(module, args):
    return (args[0] * 0.5, *args[1:])


def _magnitude_hook(module, args, kwargs, output):
    return output * 3


@pytest.mark.parametrize(
    "where, register",
    [
        ("lora_A", lambda m: m.register_forward_hook(_double)),
        ("lora_B", lambda m: m.register_forward_pre_hook(_pre_scale)),
        ("magnitude", lambda m: m.register_forward_hook(_magnitude_hook, with_kwargs=True)),
    ],
    ids=["forward-hook-on-lora_A", "pre-hook-on-lora_B", "hook-on-magnitude"],
)
def test_a_hook_that_changes_a_result_changes_flashdoras_as_peft(where, register):
    """A hook that changes what a module returns (or takes) changes flashdora's output exactly as PEFT's: logits and
    gradients of a training step, and eval logits, against PEFT from the same weights."""
    model, peft = _twins()
    for m in (model, peft):
        register(_modules(m)[where])
    flashdora.reset_stats()
    with pytest.warns(UserWarning, match="hooks"):
        backend._warned.discard(f"fallback:hooks:{'Linear' if where != 'magnitude' else 'DoraLinearLayer'}")
        got = train_step(model, make_ids(256))
    want = train_step(peft, make_ids(256))
    assert rel_err(got[1], want[1]) <= 1e-5
    assert all(rel_err(got[2][k], v) <= 1e-5 for k, v in want[2].items())
    assert any(k.startswith("peft_fallback:hooks:") for k in flashdora.stats())
    hookless = llama(dropout=0.0)
    flashdora.enable(hookless)
    assert rel_err(train_step(hookless, make_ids(256))[1], want[1]) > 1e-3  # (the hook changed the output)


def test_an_observing_hook_fires_as_often_as_under_peft():
    """Forward hooks on ``lora_A`` fire as many times as under PEFT; full backward hooks on ``lora_B`` fire too."""
    counts = {}
    model, peft = _twins()
    for name, m in (("flash", model), ("peft", peft)):
        mods = _modules(m)
        counts[name] = [0, 0]
        mods["lora_A"].register_forward_hook(lambda *a, c=counts[name]: c.__setitem__(0, c[0] + 1))
        mods["lora_B"].register_full_backward_hook(lambda *a, c=counts[name]: c.__setitem__(1, c[1] + 1))
        train_step(m, make_ids(256))
        with torch.no_grad():
            m(input_ids=make_ids(256))
    assert counts["flash"] == counts["peft"] and counts["peft"][0] > 0 and counts["peft"][1] == 1


def test_a_global_hook_runs_peft_everywhere():
    """A process-wide forward hook sees every module PEFT calls: flashdora's layers run PEFT's forward meanwhile."""
    model, peft = _twins()
    seen = {"n": 0}
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: seen.__setitem__("n", seen["n"] + 1))
    try:
        flashdora.reset_stats()
        got = train_step(model, make_ids(256))
        flash_calls = seen["n"]
        seen["n"] = 0
        want = train_step(peft, make_ids(256))
        assert flash_calls == seen["n"]
    finally:
        handle.remove()
    assert flashdora.stats().get("peft_fallback:hooks:global", 0) > 0
    assert rel_err(got[1], want[1]) <= 1e-5
    flashdora.reset_stats()
    train_step(model, make_ids(256))
    assert not any(k.startswith("peft_fallback") for k in flashdora.stats())  # removed: flashdora again


def test_legacy_weight_norm_on_lora_B_trains_as_peft():
    """``torch.nn.utils.weight_norm(lora_B)`` (a pre-forward hook that rebuilds the weight) trains two steps as PEFT
    does (flashdora reading the weight directly crashed at the second step)."""
    model, peft = _twins()
    results = []
    for m in (model, peft):
        torch.nn.utils.weight_norm(_modules(m)["lora_B"])
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        for step in range(2):
            loss, logits, _ = train_step(m, make_ids(256, step))
            opt.step()
        results.append(logits)
    assert rel_err(*results) <= 1e-5


def test_report_names_the_hook():
    model, _ = _twins()
    _modules(model)["lora_A"].register_forward_hook(_double)
    assert "peft:hooks:Linear" in flashdora.report(model, print_table=False)
