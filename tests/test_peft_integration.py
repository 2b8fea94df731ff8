import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLinear

import flashdora
from flashdora.peft import layers as peft_layers
from flashdora.peft.variant import FlashDoraLinearVariant, PeftDoraLinearVariant
from flashdora.tools.demo import build_peft_model
from tests.helpers import backward_order, rel_err
from tests.peft_models import (  # noqa: F401 (unpatched: an autouse fixture)
    MODELS,
    assert_grads_close,
    eval_logits,
    llama,
    make_ids,
    train_step,
    unpatched,
)


@pytest.mark.parametrize("make, vocab", MODELS)
def test_eval_and_train_parity_with_peft(make, vocab):
    peft_model = make(dropout=0.1)
    model = flashdora.enable(copy.deepcopy(peft_model))
    ids = make_ids(vocab)
    flashdora.reset_stats()
    assert rel_err(eval_logits(model, ids), eval_logits(peft_model, ids)) <= 1e-5
    loss, logits, grads = train_step(model, ids)
    peft_loss, peft_logits, peft_grads = train_step(peft_model, ids)
    assert rel_err(logits, peft_logits) <= 1e-5 and rel_err(loss, peft_loss) <= 1e-5
    assert_grads_close(grads, peft_grads)
    n_layers = sum(
        isinstance(v, FlashDoraLinearVariant) for m in model.modules() for v in getattr(m, "lora_variant", {}).values()
    )
    assert n_layers > 0 and flashdora.stats()["eager"] == 2 * n_layers  # one eval + one train forward each


def test_dropout_really_applies():
    # Guard for the parity test above: with dropout the training forward must differ from eval.
    model = flashdora.enable(llama(dropout=0.5))
    ids = make_ids(256)
    train_logits = train_step(model, ids)[1]
    assert rel_err(train_logits, eval_logits(model, ids)) > 1e-3


def test_gradient_checkpointing_and_input_grads():
    peft_model = llama(dropout=0.1)
    peft_model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    peft_model.enable_input_require_grads()
    model = flashdora.enable(copy.deepcopy(peft_model))
    ids = make_ids(256)
    loss, _, grads = train_step(model, ids)
    peft_loss, _, peft_grads = train_step(peft_model, ids)
    assert rel_err(loss, peft_loss) <= 1e-5
    assert_grads_close(grads, peft_grads)


def test_enable_disable_round_trip_and_idempotence():
    model = llama()
    ids = make_ids(256)
    keys = list(model.state_dict())
    ref = eval_logits(model, ids)
    flashdora.enable(model)
    flashdora.enable(model)
    assert all(
        isinstance(v, FlashDoraLinearVariant) for m in model.modules() for v in getattr(m, "lora_variant", {}).values()
    )
    flashdora.disable(model)
    flashdora.disable(model)
    flashdora.reset_stats()
    assert torch.equal(eval_logits(model, ids), ref)
    assert list(model.state_dict()) == keys
    assert flashdora.stats() == {}  # PEFT's path ran: no flashdora counters


def test_layer_class_swap_is_invisible_and_falls_back_to_peft(monkeypatch):
    """``enable`` re-classes PEFT's LoRA Linear layers (a leaner dispatch) and ``disable`` restores them: the printed
    model, copies and pickles stay the same, and calls the lean path does not take run PEFT's forward."""
    import io

    from flashdora.peft.layers import FlashDoraLinear

    model = llama()
    text = repr(model)
    ids = make_ids(256)
    flashdora.enable(model)
    layers = [m for m in model.modules() if isinstance(m, PeftLinear)]
    assert layers and all(type(m) is FlashDoraLinear for m in layers)
    assert repr(model) == text
    ref = eval_logits(model, ids)
    assert torch.equal(eval_logits(copy.deepcopy(model), ids), ref)
    with monkeypatch.context() as m:  # plain calls of flashdora layers never reach PEFT's Linear.forward
        m.setattr(peft_layers, "_PEFT_LINEAR_FORWARD", None)
        assert torch.equal(eval_logits(model, ids), ref)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert torch.equal(eval_logits(torch.load(buf, weights_only=False), ids), ref)
    peft_model = flashdora.disable(copy.deepcopy(model))
    assert all(type(m) is PeftLinear for m in peft_model.modules() if isinstance(m, PeftLinear))
    layer = layers[0]
    with pytest.raises(ValueError, match="adapter_names"):  # PEFT's own check, via its forward
        layer(torch.randn(2, 3, layer.in_features), adapter_names=["default"])
    flashdora.reset_stats()
    with model.disable_adapter(), peft_model.disable_adapter():  # PEFT's forward: the base layers alone
        assert torch.equal(eval_logits(model, ids), eval_logits(peft_model, ids))
    assert flashdora.stats() == {}


def test_merge_unmerge_and_merge_and_unload():
    model = flashdora.enable(llama())
    ids = make_ids(256)
    ref = eval_logits(model, ids)
    model.merge_adapter()
    assert rel_err(eval_logits(model, ids), ref) <= 1e-5
    model.unmerge_adapter()
    assert rel_err(eval_logits(model, ids), ref) <= 1e-5
    merged = model.merge_and_unload()
    assert rel_err(eval_logits(merged, ids), ref) <= 1e-5


def test_save_with_flashdora_load_in_plain_peft_and_back(tmp_path):
    model = flashdora.enable(llama())
    ids = make_ids(256)
    train_step(model, ids)  # some training so the adapter differs from its init
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "magnitude" in name:
                p.mul_(1.01)
    ref = eval_logits(model, ids)
    model.save_pretrained(tmp_path / "a")
    base = build_peft_model("tiny", 8, 0.1, "cpu", seed=0).unload()  # the same base weights, no adapter
    plain = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "a")
    assert rel_err(eval_logits(plain, ids), ref) <= 1e-5
    plain.save_pretrained(tmp_path / "b")
    again = flashdora.enable(PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "b"))
    assert rel_err(eval_logits(again, ids), ref) <= 1e-5
    assert sorted((tmp_path / "a").iterdir()) and {p.name for p in (tmp_path / "a").iterdir()} == {
        p.name for p in (tmp_path / "b").iterdir()
    }


def test_multiple_adapters_and_switching():
    peft_model = llama()
    torch.manual_seed(5)
    second = LoraConfig(r=4, lora_alpha=4, use_dora=True, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model.add_adapter("other", second)
    model = flashdora.enable(copy.deepcopy(peft_model))
    ids = make_ids(256)
    for name in ("default", "other", "default"):
        model.set_adapter(name)
        peft_model.set_adapter(name)
        assert rel_err(eval_logits(model, ids), eval_logits(peft_model, ids)) <= 1e-5, name
    with model.disable_adapter(), peft_model.disable_adapter():
        assert torch.equal(eval_logits(model, ids), eval_logits(peft_model, ids))


def test_patch_peft_covers_existing_and_new_layers():
    existing = llama()
    ids = make_ids(256)
    ref = eval_logits(existing, ids)
    flashdora.patch_peft()
    flashdora.patch_peft()  # idempotent
    flashdora.reset_stats()
    assert rel_err(eval_logits(existing, ids), ref) <= 1e-5
    created = llama()
    with pytest.MonkeyPatch.context() as m:  # PEFT's Linear takes the lean forward: plain calls never reach PEFT's
        m.setattr(peft_layers, "_PEFT_LINEAR_FORWARD", None)
        eval_logits(created, ids)
    n = flashdora.stats()["eager"]
    assert n == 2 * 14  # 2 layers x 7 projections, in both models
    flashdora.disable(existing)  # an explicit per-model choice wins over the process-wide patch
    flashdora.reset_stats()
    eval_logits(existing, ids)
    assert flashdora.stats() == {}
    flashdora.unpatch_peft()
    flashdora.unpatch_peft()
    assert PeftLinear.forward is peft_layers._PEFT_LINEAR_FORWARD
    eval_logits(created, ids)
    assert flashdora.stats() == {}


def test_fallbacks_are_counted_and_warned():
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 8)
            self.conv = torch.nn.Conv2d(8, 8, 1)
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, ids):
            h = self.emb(ids)  # [B, T, 8]
            h = self.conv(h.transpose(1, 2)[..., None])[..., 0].transpose(1, 2)
            return self.lin(h)

    config = LoraConfig(r=2, use_dora=True, target_modules=["emb", "conv", "lin"], init_lora_weights=False)
    peft_model = get_peft_model(Net(), config)
    model = flashdora.enable(copy.deepcopy(peft_model))
    ids = torch.randint(0, 20, (2, 5))
    flashdora.reset_stats()
    with pytest.warns(UserWarning, match="flashdora: DoRA (embedding|conv) layers run PEFT's own code"):
        out = model(ids)
    assert rel_err(out, peft_model(ids)) <= 1e-5
    counts = flashdora.stats()
    fallbacks = {"peft_fallback:embedding": 1, "peft_fallback:conv": 1}
    assert counts == {**fallbacks, "eager": 1, "norm:eager": 1, "norm:base_sq": 1}
    text = flashdora.report(model, print_table=False)
    assert "peft:embedding" in text and "peft:conv" in text and "flashdora:eager" in text
    flashdora.disable(model)
    flashdora.reset_stats()
    model(ids)
    assert flashdora.stats() == {}


def test_lora_bias_falls_back_to_peft():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 6))
    # PEFT's config refuses lora_bias with DoRA, but a bias put on lora_B by hand still reaches DoRA's forward.
    config = LoraConfig(r=2, use_dora=True, target_modules=["0"], init_lora_weights=False)
    peft_model = get_peft_model(net, config)
    peft_model.base_model.model[0].lora_B["default"].bias = torch.nn.Parameter(torch.randn(6))
    model = flashdora.enable(copy.deepcopy(peft_model))
    x = torch.randn(3, 8)
    flashdora.reset_stats()
    with pytest.warns(UserWarning, match=r"lora_bias"):
        out = model(x)
    assert rel_err(out, peft_model(x)) <= 1e-6
    assert flashdora.stats() == {"peft_fallback:lora_bias": 1}  # no norm either: PEFT's code ran
    assert "peft:lora_bias" in flashdora.report(model, print_table=False)


def test_enable_rejects_non_modules():
    with pytest.raises(TypeError, match="enable: model expected a torch.nn.Module, got str"):
        flashdora.enable("model")
    with pytest.raises(TypeError, match="disable: model expected a torch.nn.Module"):
        flashdora.disable(None)


def test_disable_pins_peft_class():
    model = flashdora.disable(llama())
    assert all(
        type(v) is PeftDoraLinearVariant for m in model.modules() for v in getattr(m, "lora_variant", {}).values()
    )


@pytest.mark.parametrize("lead", [(6,), (2, 3)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_base_layer_backward_runs_before_the_lora_a_matmul(monkeypatch, lead, bias):
    """The base layer's gradient ``g dy`` is freed before the LoRA A path allocates its ``d x`` (one block less at
    the peak, ``ops.compose.after_base``). Without the reordering the A matmul's node runs first."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 12, bias=bias)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["0"], use_dora=True, init_lora_weights=False)
    model = flashdora.enable(get_peft_model(torch.nn.Sequential(linear), config))
    layer = model.base_model.model[0]
    x = torch.randn(*lead, 16, requires_grad=True)
    order = backward_order(layer(x))
    assert "a" in order and set(order[:-1]) == {"base"} and order[-1] == "a"
    monkeypatch.setattr(peft_layers, "after_base", lambda: -1)
    assert backward_order(layer(x))[0] == "a"
