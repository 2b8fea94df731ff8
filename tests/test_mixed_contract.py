"""The mixed-adapter batch (``peft/mixed.py``) keeps the single-adapter path's contract: what makes a single call
fresh makes a mixed call fresh, and what the single path honours the mixed path honours or hands to PEFT's
per-adapter loop, counted. Each case against PEFT computing each row under its own adapter: the norm cache off
(``enable``'s and ``configure``'s) across ``.data`` writes, ``disable``/``enable`` of one layer, dropout modules in
training mode or replaced, parameters added to an adapter's modules, and float64 models (exact)."""

import pytest
import torch
from torch import nn

import flashdora
from flashdora import config
from tests.helpers import rel_err
from tests.mixed_models import NAMES, SPECS, build, ids_for, mixed, per_adapter
from tests.peft_models import unpatched  # noqa: F401 - the autouse fixture: PEFT runs its own code


def _layer(model, i=0, name="q_proj"):
    block = model.base_model.model.model.layers[i]
    return getattr(block.self_attn, name, None) or getattr(block.mlp, name)


def _call(model, ids, names=NAMES):
    with torch.no_grad():  # (no ``enable`` before it: ``enable`` drops the kept packs)
        return model(input_ids=ids, adapter_names=names).logits


@pytest.mark.parametrize("how", ["enable", "configure"])
def test_mixed_norm_cache_off_follows_data_writes(how):
    """With the norm cache off (``enable(norm_cache=False)`` or ``configure(norm_cache=False)``) a single call
    recomputes its norm every call, so writes no version counter sees (``p.data.copy_``) reach it; so they reach a
    mixed call: no kept pack, no kept norm; once the cache is on again, ``invalidate`` (the documented rule for such
    writes) makes the next call fresh. Writes to a DoRA adapter's B and magnitude, a LoRA adapter's A, and the base
    weight."""
    model = build()
    ids = ids_for(NAMES)
    flashdora.enable(model, norm_cache=how != "enable")
    before = _call(model, ids)  # (packs kept here with the cache on)
    with config.override(norm_cache=how != "configure"):
        _call(model, ids)
        layer = _layer(model, 1, "down_proj")
        with torch.no_grad():
            for p in (layer.lora_B["d1"].weight, layer.lora_magnitude_vector["d2"].weight, layer.lora_A["l1"].weight,
                      _layer(model, 0).base_layer.weight):  # fmt: skip
                p.data.copy_(torch.randn_like(p))
        out = _call(model, ids)
    flashdora.invalidate(model)  # (the cache on again: writes no counter sees need it, as for single calls)
    again = _call(model, ids)
    ref = per_adapter(model, ids, NAMES)
    assert rel_err(out, before) > 1e-3
    assert rel_err(out, ref) <= 1e-5 and rel_err(again, ref) <= 1e-5


def test_mixed_follows_disable_and_enable_of_one_layer():
    """After a mixed call, ``disable`` of one LoRA layer puts it on PEFT's own code, which refuses ``adapter_names``
    with DoRA adapters (PEFT's error, not that layer silently running its active adapter for every row); ``enable``
    of that layer again gives each row PEFT's output for its adapter."""
    model = build()
    ids = ids_for(NAMES)
    mixed(model, ids, NAMES)
    layer = _layer(model, 0)
    flashdora.disable(layer)
    with pytest.raises(ValueError, match="DoRA is enabled"):
        _call(model, ids)
    flashdora.enable(layer)
    out = _call(model, ids)
    assert rel_err(out, per_adapter(model, ids, NAMES)) <= 1e-5


def test_mixed_disabled_layer_under_patch_peft_runs_peft_loop():
    """The same under ``patch_peft``: the disabled layer's class runs flashdora's forward, its variants PEFT's DoRA:
    PEFT's per-adapter loop there, counted; each row PEFT's."""
    model = build()
    ids = ids_for(NAMES)
    ref = per_adapter(model, ids, NAMES)
    mixed(model, ids, NAMES)
    flashdora.patch_peft()
    try:
        flashdora.disable(_layer(model, 0))
        flashdora.reset_stats()
        out = _call(model, ids)
    finally:
        flashdora.unpatch_peft()
    assert rel_err(out, ref) <= 1e-5
    assert flashdora.stats().get("peft_fallback:mixed-batch:variant:PeftDoraLinearVariant") == 1


class _Halve(nn.Module):
    def forward(self, x):
        return x * 0.5


def _dropout_train(layer):
    layer.lora_dropout["l1"].train()  # p = 1: zeros in training mode, deterministic


def _dropout_replaced(layer):
    layer.lora_dropout["l1"] = _Halve()


def _dropout_subclass(layer):
    layer.lora_dropout["l1"].__class__ = type("Scaled", (nn.Dropout,), {"forward": lambda self, x: x * 3})


@pytest.mark.parametrize(
    "change, why",
    [(_dropout_train, "dropout:training"), (_dropout_replaced, "dropout:_Halve"),
     (_dropout_subclass, "dropout:Scaled")],
    ids=["train-mode", "replaced", "subclass"],
)  # fmt: skip
def test_mixed_follows_dropout_modules(change, why):
    """PEFT's loop calls a LoRA adapter's dropout module on its sub-batch, whatever the layer's mode: a dropout
    module in training mode, or replaced by another module, after a pack was kept, sends the layer to PEFT's loop
    (counted), and each row is PEFT's."""
    _changed_after_a_kept_pack(build({**SPECS, "l1": dict(r=4, lora_alpha=8, lora_dropout=1.0)}), change, why)


def _changed_after_a_kept_pack(model, change, why):
    """A mixed call keeps a pack, ``change(layer)`` edits one layer, and the next mixed call takes PEFT's loop there
    (counted): each row PEFT's, and not the kept result."""
    ids = ids_for(NAMES)
    before = mixed(model, ids, NAMES)
    layer = _layer(model, 1, "up_proj")
    assert layer.__dict__["_flashdora_mixed"] is not None
    with torch.no_grad():
        change(layer)
    flashdora.reset_stats()
    out = _call(model, ids)
    assert rel_err(out, before) > 1e-4
    assert rel_err(out, per_adapter(model, ids, NAMES)) <= 1e-5
    assert flashdora.stats().get(f"peft_fallback:mixed-batch:{why}") == 1


def _lora_A_bias(layer):
    layer.lora_A["l1"].bias = nn.Parameter(torch.randn(4))  # (registered as None by nn.Linear(bias=False))


def _lora_B_bias(layer):
    layer.lora_B["d2"].bias = nn.Parameter(torch.randn(layer.out_features))


@pytest.mark.parametrize(
    "change, why", [(_lora_A_bias, "params:lora_A.bias"), (_lora_B_bias, "lora_bias")], ids=["lora_A", "lora_B"]
)
def test_mixed_follows_parameters_added_to_adapter_modules(change, why):
    """A parameter registered on an adapter's module after a pack was kept (a bias PEFT's module call adds):
    PEFT's loop there, counted, and each row PEFT's."""
    _changed_after_a_kept_pack(build(), change, why)


def test_mixed_float64_is_exact():
    """A float64 model's mixed batch is PEFT's per-adapter float64 output to float64 rounding: scalings that
    float32 cannot hold (7/3, 5/3, 3/sqrt(5)) are kept in the model's dtype."""
    specs = {
        "d1": dict(r=3, lora_alpha=7, use_dora=True),
        "d2": dict(r=5, lora_alpha=3, use_dora=True, use_rslora=True),
        "l1": dict(r=3, lora_alpha=5),
        "d3": dict(r=4, lora_alpha=4, use_dora=True),
    }
    model = build(specs, dtype=torch.float64)
    ids = ids_for(NAMES)
    ref = per_adapter(model, ids, NAMES)
    flashdora.reset_stats()
    out = mixed(model, ids, NAMES)
    assert flashdora.stats().get("mixed-eager") == 14
    assert rel_err(out, ref) <= 1e-13, rel_err(out, ref)


@pytest.mark.parametrize("mode", ["single", "mixed"])
def test_a_bias_on_a_dora_adapters_lora_A_runs_pefts_function(mode):
    """A bias registered on a DoRA adapter's ``lora_A`` (PEFT's module call adds it; the fused compose reads only
    the weight): the single path runs PEFT's forward there, counted, and so does PEFT's per-adapter loop of a mixed
    batch; every row PEFT's (it was 0.27 relative off on the single path)."""
    model = build()
    ids = ids_for(NAMES)
    layer = _layer(model, 1, "up_proj")
    with torch.no_grad():
        layer.lora_A["d1"].bias = nn.Parameter(torch.randn(8))
    flashdora.reset_stats()
    if mode == "single":
        model.set_adapter("d1")
        with torch.no_grad():
            out = flashdora.enable(model)(input_ids=ids).logits
            want = flashdora.disable(model)(input_ids=ids).logits
        assert flashdora.stats().get("peft_fallback:params:lora_A.bias") == 1
    else:
        out = mixed(model, ids, NAMES)
        want = per_adapter(model, ids, NAMES)
    assert rel_err(out, want) <= 1e-5
    assert "peft:params:lora_A.bias" in flashdora.report(flashdora.enable(model), print_table=False)
