import copy
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLinear
from transformers import GPT2Config, GPT2LMHeadModel

import flashdora
from flashdora import peft_integration
from flashdora.demo import build_peft_model
from flashdora.peft_integration import FlashDoraLinearVariant, PeftDoraLinearVariant
from tests.helpers import rel_err


@pytest.fixture(autouse=True)
def _unpatched():
    flashdora.unpatch_peft()
    yield
    flashdora.unpatch_peft()


def _llama(dropout=0.1, rank=8):
    return build_peft_model("tiny", rank, dropout, "cpu", seed=0)


def _gpt2(dropout=0.1):
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=64)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        use_dora=True,
        fan_in_fan_out=True,
        target_modules=["c_attn", "c_proj", "c_fc"],
        init_lora_weights=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(GPT2LMHeadModel(config), lora)


MODELS = [pytest.param(_llama, 256, id="llama"), pytest.param(_gpt2, 97, id="gpt2-conv1d")]


def _ids(vocab, seed=1):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def _step(model, ids, seed=123):
    """Training forward+backward with a fixed dropout seed; returns loss, logits and every trainable grad."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), out.logits.detach(), grads


@torch.no_grad()
def _eval(model, ids):
    model.eval()
    return model(input_ids=ids).logits


def _assert_grads(out_grads, peft_grads, rtol=1e-4):
    assert out_grads.keys() == peft_grads.keys()
    assert any("magnitude" in k for k in out_grads)
    for name, peft_grad in peft_grads.items():
        assert rel_err(out_grads[name], peft_grad) <= rtol, name


@pytest.mark.parametrize("make, vocab", MODELS)
def test_eval_and_train_parity_with_peft(make, vocab):
    peft_model = make(dropout=0.1)
    model = flashdora.enable(copy.deepcopy(peft_model))
    ids = _ids(vocab)
    flashdora.reset_stats()
    assert rel_err(_eval(model, ids), _eval(peft_model, ids)) <= 1e-5
    loss, logits, grads = _step(model, ids)
    peft_loss, peft_logits, peft_grads = _step(peft_model, ids)
    assert rel_err(logits, peft_logits) <= 1e-5 and rel_err(loss, peft_loss) <= 1e-5
    _assert_grads(grads, peft_grads)
    n_layers = sum(
        isinstance(v, FlashDoraLinearVariant) for m in model.modules() for v in getattr(m, "lora_variant", {}).values()
    )
    assert n_layers > 0 and flashdora.stats()["eager"] == 2 * n_layers  # one eval + one train forward each


def test_dropout_really_applies():
    # Guard for the parity test above: with dropout the training forward must differ from eval.
    model = flashdora.enable(_llama(dropout=0.5))
    ids = _ids(256)
    train_logits = _step(model, ids)[1]
    assert rel_err(train_logits, _eval(model, ids)) > 1e-3


def test_gradient_checkpointing_and_input_grads():
    peft_model = _llama(dropout=0.1)
    peft_model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    peft_model.enable_input_require_grads()
    model = flashdora.enable(copy.deepcopy(peft_model))
    ids = _ids(256)
    loss, _, grads = _step(model, ids)
    peft_loss, _, peft_grads = _step(peft_model, ids)
    assert rel_err(loss, peft_loss) <= 1e-5
    _assert_grads(grads, peft_grads)


def test_autocast_bf16_parity():
    peft_model = _llama(dropout=0.0)
    peft_model.base_model.model.to(torch.bfloat16)
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # PEFT's default: fp32 adapters on a bf16 model
    model = flashdora.enable(copy.deepcopy(peft_model))
    ids = _ids(256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _eval(model, ids)
        ref = _eval(peft_model, ids)
        loss, _, grads = _step(model, ids)
        peft_loss, _, peft_grads = _step(peft_model, ids)
    assert out.dtype == ref.dtype
    assert rel_err(out, ref) <= 2e-2 and rel_err(loss, peft_loss) <= 1e-2
    _assert_grads(grads, peft_grads, rtol=5e-2)


def test_enable_disable_round_trip_and_idempotence():
    model = _llama()
    ids = _ids(256)
    keys = list(model.state_dict())
    ref = _eval(model, ids)
    flashdora.enable(model)
    flashdora.enable(model)
    assert all(
        isinstance(v, FlashDoraLinearVariant) for m in model.modules() for v in getattr(m, "lora_variant", {}).values()
    )
    flashdora.disable(model)
    flashdora.disable(model)
    flashdora.reset_stats()
    assert torch.equal(_eval(model, ids), ref)
    assert list(model.state_dict()) == keys
    assert flashdora.stats() == {}  # PEFT's path ran: no flashdora counters


def test_layer_class_swap_is_invisible_and_falls_back_to_peft(monkeypatch):
    """``enable`` re-classes PEFT's LoRA Linear layers (a leaner dispatch) and ``disable`` restores them: the printed
    model, copies and pickles stay the same, and calls the lean path does not take run PEFT's forward."""
    import io

    from flashdora.peft_integration import FlashDoraLinear

    model = _llama()
    text = repr(model)
    ids = _ids(256)
    flashdora.enable(model)
    layers = [m for m in model.modules() if isinstance(m, PeftLinear)]
    assert layers and all(type(m) is FlashDoraLinear for m in layers)
    assert repr(model) == text
    ref = _eval(model, ids)
    assert torch.equal(_eval(copy.deepcopy(model), ids), ref)
    with monkeypatch.context() as m:  # plain calls of flashdora layers never reach PEFT's Linear.forward
        m.setattr(peft_integration, "_PEFT_LINEAR_FORWARD", None)
        assert torch.equal(_eval(model, ids), ref)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert torch.equal(_eval(torch.load(buf, weights_only=False), ids), ref)
    peft_model = flashdora.disable(copy.deepcopy(model))
    assert all(type(m) is PeftLinear for m in peft_model.modules() if isinstance(m, PeftLinear))
    layer = layers[0]
    with pytest.raises(ValueError, match="adapter_names"):  # PEFT's own check, via its forward
        layer(torch.randn(2, 3, layer.in_features), adapter_names=["default"])
    flashdora.reset_stats()
    with model.disable_adapter(), peft_model.disable_adapter():  # PEFT's forward: the base layers alone
        assert torch.equal(_eval(model, ids), _eval(peft_model, ids))
    assert flashdora.stats() == {}


def test_merge_unmerge_and_merge_and_unload():
    model = flashdora.enable(_llama())
    ids = _ids(256)
    ref = _eval(model, ids)
    model.merge_adapter()
    assert rel_err(_eval(model, ids), ref) <= 1e-5
    model.unmerge_adapter()
    assert rel_err(_eval(model, ids), ref) <= 1e-5
    merged = model.merge_and_unload()
    assert rel_err(_eval(merged, ids), ref) <= 1e-5


def test_save_with_flashdora_load_in_plain_peft_and_back(tmp_path):
    model = flashdora.enable(_llama())
    ids = _ids(256)
    _step(model, ids)  # some training so the adapter differs from its init
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "magnitude" in name:
                p.mul_(1.01)
    ref = _eval(model, ids)
    model.save_pretrained(tmp_path / "a")
    base = build_peft_model("tiny", 8, 0.1, "cpu", seed=0).unload()  # the same base weights, no adapter
    plain = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "a")
    assert rel_err(_eval(plain, ids), ref) <= 1e-5
    plain.save_pretrained(tmp_path / "b")
    again = flashdora.enable(PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "b"))
    assert rel_err(_eval(again, ids), ref) <= 1e-5
    assert sorted((tmp_path / "a").iterdir()) and {p.name for p in (tmp_path / "a").iterdir()} == {
        p.name for p in (tmp_path / "b").iterdir()
    }


def test_multiple_adapters_and_switching():
    peft_model = _llama()
    torch.manual_seed(5)
    second = LoraConfig(r=4, lora_alpha=4, use_dora=True, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model.add_adapter("other", second)
    model = flashdora.enable(copy.deepcopy(peft_model))
    ids = _ids(256)
    for name in ("default", "other", "default"):
        model.set_adapter(name)
        peft_model.set_adapter(name)
        assert rel_err(_eval(model, ids), _eval(peft_model, ids)) <= 1e-5, name
    with model.disable_adapter(), peft_model.disable_adapter():
        assert torch.equal(_eval(model, ids), _eval(peft_model, ids))


def test_patch_peft_covers_existing_and_new_layers():
    existing = _llama()
    ids = _ids(256)
    ref = _eval(existing, ids)
    flashdora.patch_peft()
    flashdora.patch_peft()  # idempotent
    flashdora.reset_stats()
    assert rel_err(_eval(existing, ids), ref) <= 1e-5
    created = _llama()
    with pytest.MonkeyPatch.context() as m:  # PEFT's Linear takes the lean forward: plain calls never reach PEFT's
        m.setattr(peft_integration, "_PEFT_LINEAR_FORWARD", None)
        _eval(created, ids)
    n = flashdora.stats()["eager"]
    assert n == 2 * 14  # 2 layers x 7 projections, in both models
    flashdora.disable(existing)  # an explicit per-model choice wins over the process-wide patch
    flashdora.reset_stats()
    _eval(existing, ids)
    assert flashdora.stats() == {}
    flashdora.unpatch_peft()
    flashdora.unpatch_peft()
    assert PeftLinear.forward is peft_integration._PEFT_LINEAR_FORWARD
    _eval(created, ids)
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
    assert counts == {"peft_fallback:embedding": 1, "peft_fallback:conv": 1, "eager": 1, "norm:eager": 1}
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
    model = flashdora.disable(_llama())
    assert all(
        type(v) is PeftDoraLinearVariant for m in model.modules() for v in getattr(m, "lora_variant", {}).values()
    )


def _bf16_model_fp32_adapters(dropout):
    peft_model = _llama(dropout=dropout)
    peft_model.base_model.model.to(torch.bfloat16)
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return flashdora.enable(peft_model)


def _seen_lora_inputs(model, run):
    """The dtypes of ``x`` that flashdora's variant receives while ``run()`` runs."""
    from flashdora import peft_integration

    seen, original = [], peft_integration.compose

    def spy(result, lx, *args, **kwargs):
        seen.append(lx.dtype)
        return original(result, lx, *args, **kwargs)

    peft_integration.compose = spy
    try:
        run()
    finally:
        peft_integration.compose = original
    return seen


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_input_cast_skip_is_bitwise_neutral(monkeypatch, dropout):
    """Under autocast, PEFT's cast of x to the fp32 adapters' dtype is skipped on flashdora layers without active
    dropout; outputs and every gradient stay bitwise equal to running with PEFT's cast."""
    from flashdora import peft_integration

    model = _bf16_model_fp32_adapters(dropout)
    ids = _ids(256)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _eval(model, ids), _step(model, ids)

    seen = []
    fast = _seen_lora_inputs(model, lambda: seen.append(run()))
    with monkeypatch.context() as m:
        m.setattr(peft_integration.LoraLayer, "_cast_input_dtype", peft_integration._PEFT_CAST)
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
    ids = _ids(256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen = _seen_lora_inputs(model, lambda: _eval(model, ids))
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
    dropout and with ``s`` not a power of two, one rounding of the LoRA weight gradients (docs/decisions.md)."""
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
