"""Mixed-adapter batches (``peft/mixed.py``) after changes: a kept pack is rebuilt or left for PEFT's loop after
training, in-place edits, ``set_scale``, new tensors and storage, ``enable``, hooks, instance forwards, replaced and
re-classed modules, and gradients; each row stays PEFT's for its adapter. The kept pack's check runs in Python and,
once the C++ extension is adopted, in C++ (``csrc/check.cpp``): both are tested."""

import pytest
import torch

import flashdora
from flashdora import native
from flashdora.native import bridge as native_bridge
from flashdora.peft import mixed as peft_mixed
from tests.helpers import native_extension, rel_err
from tests.mixed_models import NAMES, build, ids_for, mixed, per_adapter
from tests.peft_models import unpatched  # noqa: F401 - the autouse fixture: PEFT runs its own code


@pytest.fixture(params=["python", "cpp"])
def check(request, monkeypatch):
    """The kept pack's check in Python, or in C++ (the extension built and adopted); in C++, the test fails unless
    the C++ check ran."""
    if request.param == "python":
        monkeypatch.setattr(native.build, "_module", None)
        yield request.param
        return
    mod = native_extension()
    monkeypatch.setattr(native.build, "_module", mod)
    ran = []
    real = native_bridge.held_unchanged
    monkeypatch.setattr(native_bridge, "held_unchanged", lambda held: ran.append(1) or real(held))
    yield request.param
    assert ran, "the C++ check never ran"


def test_mixed_after_training_and_edits_serves_no_stale_norm(check):
    """A pack kept from a first mixed call is rebuilt after an AdamW step on one adapter, an in-place edit of a LoRA
    adapter's B and of another DoRA adapter's magnitude, and a ``set_scale``: each row stays PEFT's."""
    model = build()
    ids = ids_for(NAMES)
    mixed(model, ids, NAMES)  # packs and norms cached
    model.set_adapter("d1")
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    assert rel_err(mixed(model, ids, NAMES), per_adapter(model, ids, NAMES)) <= 1e-5
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["l1"].weight.mul_(3.0)
        layer.lora_magnitude_vector["d2"].weight.add_(0.5)
    layer.set_scale("d3", 2.0)
    assert rel_err(mixed(model, ids, NAMES), per_adapter(model, ids, NAMES)) <= 1e-5
    flashdora.enable(model)
    with torch.no_grad():
        mixed_out = model(input_ids=ids, adapter_names=NAMES).logits  # packs kept: the fast check serves them
        weight = layer.lora_A["d1"].weight
        weight.data = weight.data * 0.5  # new storage, twice (a freed address may come back: the packs hold it)
        weight.data = weight.data * 3.0
        layer.lora_A["l1"].weight = torch.nn.Parameter(layer.lora_A["l1"].weight * 2)
        edited = model(input_ids=ids, adapter_names=NAMES).logits
    assert rel_err(mixed_out, edited) > 1e-3
    assert rel_err(edited, per_adapter(model, ids, NAMES)) <= 1e-5


def test_mixed_pack_kept_and_norms_once():
    model = build()
    ids = ids_for(NAMES)
    mixed(model, ids, NAMES)
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    pack = layer.__dict__["_flashdora_mixed"]
    assert pack.adapters == ("d1", "d2", "d3", "l1")
    flashdora.reset_stats()
    with torch.no_grad():
        model(input_ids=ids, adapter_names=NAMES)
    assert layer.__dict__["_flashdora_mixed"] is pack
    stats = flashdora.stats()
    assert stats.get("mixed-eager") == 14 and "norm:eager" not in stats, stats  # (the kept packs: no norm asked)
    with torch.no_grad():  # a write no version counter sees, then ``enable`` (the documented way): packs dropped
        layer.lora_B["d1"].weight.data.copy_(torch.randn_like(layer.lora_B["d1"].weight))
    assert rel_err(mixed(model, ids, NAMES), per_adapter(model, ids, NAMES)) <= 1e-5


def test_mixed_hooks_and_grad_take_peft_loop():
    """A hook on an adapter module, or gradients, send the layer to PEFT's sub-batch loop (counted): still PEFT's
    values, the hook fires."""
    model = build()
    ids = ids_for(NAMES)
    ref = per_adapter(model, ids, NAMES)
    calls = []
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    handle = layer.lora_A["d2"].register_forward_hook(lambda *a: calls.append(1))
    flashdora.reset_stats()
    assert rel_err(mixed(model, ids, NAMES), ref) <= 1e-5
    handle.remove()
    assert calls and flashdora.stats().get("peft_fallback:mixed-batch:hooks:Linear") == 1
    flashdora.reset_stats()
    out = model(input_ids=ids, adapter_names=NAMES).logits  # grad enabled, adapters trainable
    assert rel_err(out.detach(), ref) <= 1e-5
    assert flashdora.stats().get("peft_fallback:mixed-batch:grad") == 14


@pytest.mark.parametrize("private", [True, False], ids=["hook-epoch", "every-call"])
def test_mixed_kept_pack_follows_hooks_and_module_changes(private, check, monkeypatch):
    """After packs are kept, each change PEFT would see through its module calls reaches the next mixed call: a
    forward hook that changes ``lora_A``'s output (PEFT's loop runs, the hook fires), a pre-hook on a dropout module,
    an instance ``forward`` on ``lora_B``, a module replaced in ``lora_A``, and a ``lora_B`` re-classed.
    With ``private_apis`` off the hook registration count is not read and every call checks the hooks."""
    monkeypatch.setattr(flashdora.config, "private", private)
    model = build()
    ids = ids_for(NAMES)
    mixed(model, ids, NAMES)  # packs kept
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    assert layer.__dict__["_flashdora_mixed"] is not None
    calls = []

    def doubled(module, args, output):
        calls.append(1)
        return output * 2

    def check(why):
        with torch.no_grad():  # (no ``enable`` before it: that drops the packs)
            out = model(input_ids=ids, adapter_names=NAMES).logits
        ref = per_adapter(model, ids, NAMES)
        mixed(model, ids, NAMES)  # enabled again, packs rebuilt and kept, the hook registration count read
        assert rel_err(out, ref) <= 1e-5, why

    def kept():  # packs kept before each change, the hook registration count read since the last one
        with torch.no_grad():
            model(input_ids=ids, adapter_names=NAMES)
        assert layer.__dict__["_flashdora_mixed"] is not None

    handle = layer.lora_A["d2"].register_forward_hook(doubled)
    flashdora.reset_stats()
    check("forward hook")
    assert calls and flashdora.stats().get("peft_fallback:mixed-batch:hooks:Linear") == 2  # (both calls of check)
    handle.remove()
    kept()
    handle = layer.lora_dropout["d1"].register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    check("dropout pre-hook")
    handle.remove()
    kept()
    lora_B = layer.lora_B["d1"]
    lora_B.forward = lambda x: torch.nn.functional.linear(x, lora_B.weight) * 3
    check("instance forward")
    del lora_B.forward
    kept()
    torch.manual_seed(5)
    layer.lora_A["d3"] = torch.nn.Linear(64, 4, bias=False)
    check("module replaced")
    kept()
    lora_B = layer.lora_B["d2"]
    lora_B.__class__ = type(
        "Tripled", (torch.nn.Linear,), {"forward": lambda self, x: super(type(self), self).forward(x) * 3}
    )
    check("class changed")
    assert flashdora.stats().get("peft_fallback:mixed-batch:hooks:Tripled") == 2


def test_cpp_check_agrees_with_python_on_each_change(monkeypatch):
    """``held_unchanged`` in C++ against the Python passes, on one layer's kept pack: both say unchanged, then both
    say changed after each of: an in-place edit, new storage (``.data``), a new Parameter, a module replaced, a
    module re-classed, an instance ``forward``."""
    mod = native_extension()
    monkeypatch.setattr(native.build, "_module", None)  # (the packs below are built with the Python check)
    model = build()
    ids = ids_for(NAMES)

    def both(layer):
        held = layer.__dict__[peft_mixed._HELD]
        monkeypatch.setattr(native.build, "_module", mod)
        cpp = native_bridge.held_unchanged(held)
        monkeypatch.setattr(native.build, "_module", None)
        x = torch.zeros(1, 1, layer.in_features)
        python = peft_mixed._unchanged(layer, layer.base_layer, held.key[0], x)
        return cpp, python

    def fresh():
        mixed(model, ids, NAMES)
        layer = model.base_model.model.model.layers[1].mlp.down_proj
        assert both(layer) == (True, True)
        return layer

    def edit_in_place(layer):
        with torch.no_grad():
            layer.lora_A["d2"].weight.mul_(2.0)

    def new_storage(layer):
        layer.lora_B["l1"].weight.data = layer.lora_B["l1"].weight.data.clone()

    def new_parameter(layer):
        layer.lora_magnitude_vector["d3"].weight = torch.nn.Parameter(layer.lora_magnitude_vector["d3"].weight * 1)

    def module_replaced(layer):
        layer.lora_dropout["d1"] = torch.nn.Identity()

    def reclassed(layer):
        layer.lora_A["l1"].__class__ = type("Other", (torch.nn.Linear,), {})

    def instance_forward(layer):
        layer.lora_B["d3"].forward = layer.lora_B["d3"].forward

    for change in (edit_in_place, new_storage, new_parameter, module_replaced, reclassed, instance_forward):
        layer = fresh()
        change(layer)
        assert both(layer) == (False, False), change.__name__
        if "forward" in layer.lora_B["d3"].__dict__:
            del layer.lora_B["d3"].forward
        if type(layer.lora_A["l1"]).__name__ == "Other":
            layer.lora_A["l1"].__class__ = torch.nn.Linear
