"""A bitsandbytes layer's base result computed by flashdora (``quant.base``): the layer's own values, bit for bit, only
where flashdora makes the calls bitsandbytes makes (4-bit: where it dequantizes and calls ``F.linear``; 8-bit: its
int8 product, with or without outlier columns); a 4-bit layer's dense weight handed to the norm-cache miss; PEFT's
``lora.bnb`` classes re-classed by ``enable`` and patched by ``patch_peft``.

On the CPU bitsandbytes' ``gemm_4bit`` always dequantizes, so these tests let the path run here (``DEVICES``); on
CUDA it runs past bitsandbytes' fused-kernel cutoff (tests marked gpu)."""

import copy
import pickle

import pytest
import torch

import flashdora
from tests.helpers import rel_err
from tests.peft_models import make_ids, train_step, unpatched  # noqa: F401 (fixture)
from tests.qdora_models import bf16_model, int8_bf16_model, qdora_model

bnb = pytest.importorskip("bitsandbytes")
from flashdora.peft import layers as peft_layers  # noqa: E402
from flashdora.quant import base as bnb_base  # noqa: E402
from flashdora.quant import dequant as bnb_dequant  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(bnb_base, "DEVICES", ("cuda", "cpu"))


def _bases(model):
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _count_dequantize(monkeypatch):
    calls = []
    real = bnb.functional.dequantize_4bit
    monkeypatch.setattr(bnb.functional, "dequantize_4bit", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _run(model, fast, monkeypatch, steps=2):
    """Eval logits, then ``steps`` training steps (AdamW): each step's logits and gradients."""
    monkeypatch.setattr(bnb_base, "DEVICES", ("cuda", "cpu") if fast else ("cuda",))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.eval()
    with torch.no_grad():
        out = [model(input_ids=make_ids(256, 7)).logits]
    for step in range(steps):
        _, logits, grads = train_step(model, make_ids(256, step))
        opt.step()
        out += [logits, *grads.values()]
    return out


@pytest.mark.parametrize("build", [qdora_model, bf16_model, lambda: qdora_model(peft_bnb=True)],
                         ids=["fp32", "bf16", "peft-bnb-class"])  # fmt: skip
def test_base_result_is_the_layers_own_bit_for_bit(build, monkeypatch):
    """Eval logits, and logits and gradients over two optimizer steps (weights change, so every step misses), are
    the same bits with flashdora's base result and with the layer's own call; the path ran on every layer."""
    model = build()
    flashdora.enable(model)
    twin = copy.deepcopy(model)
    flashdora.reset_stats()
    got = _run(model, True, monkeypatch)
    n_calls = flashdora.stats().get("base:4bit", 0)
    flashdora.reset_stats()
    want = _run(twin, False, monkeypatch)
    assert n_calls == 3 * len(_bases(model)) and "base:4bit" not in flashdora.stats()  # (eval + 2 training steps)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_miss_takes_the_forwards_dense_weight(on_cpu, monkeypatch):
    """A cache miss uses the weight the layer's forward has just dequantized: one dequantization fewer per layer and
    step than with nothing handed over (and the same logits and gradients)."""
    counts, results = [], []
    for share in (True, False):
        model = qdora_model()
        flashdora.enable(model)
        if not share:
            monkeypatch.setattr(bnb_dequant, "kept_dense", lambda packed, state: None)
        calls = _count_dequantize(monkeypatch)
        _, logits, grads = train_step(model, make_ids(256))
        counts.append(len(calls))
        results.append([logits, *grads.values()])
        monkeypatch.undo()
        monkeypatch.setattr(bnb_base, "DEVICES", ("cuda", "cpu"))
    assert counts[0] == counts[1] - len(_bases(model)), counts
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert bnb_dequant._dense is None  # released at the end of each layer's call


def _hooked(layer):
    layer.register_forward_hook(lambda *a: None)


def _replaced(layer):
    layer.forward = layer.forward  # (what accelerate's hooks do: an instance forward)


def _trained_bias(layer):
    layer.bias = torch.nn.Parameter(torch.zeros(layer.out_features))


def _few_rows(layer):
    bnb_base._ROWS["cpu"] = 10**6


def _other_compute_dtype(layer):
    layer.compute_dtype = torch.bfloat16  # (the weight dequantizes to float32: bitsandbytes casts x instead)


def _bias_needs_cast(layer):
    layer.bias = torch.nn.Parameter(torch.zeros(layer.out_features, dtype=torch.bfloat16), requires_grad=False)


def test_a_4bit_layers_first_call_takes_the_route_of_later_calls(on_cpu, monkeypatch):
    """The first call of a 4-bit layer (its compute dtype not set yet, its quant state off the weight) takes the
    shortcut as every later call does, doing bitsandbytes' first-call work itself: a checkpointed forward and its
    recomputation save the same tensors. Logits and gradients equal the path off's, bit for bit."""
    monkeypatch.setattr(bnb_base, "_ROWS", {})
    model = qdora_model()
    for layer in _bases(model):
        layer.compute_type_is_set = False
        layer.compute_dtype = None
    flashdora.enable(model)
    twin = copy.deepcopy(model)
    flashdora.reset_stats()
    _, logits, grads = train_step(model, make_ids(256))
    assert flashdora.stats()["base:4bit"] == len(_bases(model))
    assert all(layer.compute_type_is_set for layer in _bases(model))
    monkeypatch.setattr(bnb_base, "DEVICES", ())
    _, want_logits, want_grads = train_step(twin, make_ids(256))
    assert torch.equal(logits, want_logits) and all(torch.equal(grads[k], v) for k, v in want_grads.items())


@pytest.mark.parametrize("change", [_hooked, _replaced, _trained_bias, _few_rows, _other_compute_dtype,
                                    _bias_needs_cast],
                         ids=["forward-hook", "instance-forward", "bias-trains", "under-the-cutoff",
                              "other-compute-dtype", "bias-needs-a-cast"])  # fmt: skip
def test_the_layers_own_call_where_anything_could_differ(change, on_cpu, monkeypatch):
    """Hooks, a replaced forward, a bias that trains or needs bitsandbytes' in-place cast, fewer rows than its
    fused-kernel cutoff, a compute dtype other than the weight's: the layer's own call runs
    (none counted): the logits and gradients are those of the same model with the path off, bit for bit, and
    within 1e-4 of PEFT's own QDoRA's (1e-2 where the base computes in bf16)."""
    monkeypatch.setattr(bnb_base, "_ROWS", {})
    model = qdora_model()
    for layer in _bases(model):
        change(layer)
    peft = copy.deepcopy(model)
    flashdora.enable(model)
    twin = copy.deepcopy(model)
    flashdora.reset_stats()
    _, logits, grads = train_step(model, make_ids(256))
    assert "base:4bit" not in flashdora.stats()
    monkeypatch.setattr(bnb_base, "DEVICES", ())
    for other, exact in [(twin, True), (peft, False)]:
        _, want_logits, want_grads = train_step(other, make_ids(256))
        assert grads.keys() == want_grads.keys()
        tol = 1e-2 if change is _other_compute_dtype else 1e-4
        for got, want in [(logits, want_logits), *((grads[k], v) for k, v in want_grads.items())]:
            assert torch.equal(got, want) if exact else rel_err(got, want) <= tol


def test_a_module_only_named_like_bitsandbytes_runs_its_own_call(on_cpu):
    """``plan`` and ``run`` on a module whose class is only named ``Linear4bit`` / ``Linear8bitLt``: its own call, no
    error."""

    class Linear4bit(torch.nn.Linear):
        pass

    class Linear8bitLt(torch.nn.Linear):
        pass

    x = torch.randn(3, 8)
    for layer in (Linear4bit(8, 4), Linear8bitLt(8, 4)):
        out, fresh = bnb_base.run(layer, x, bnb_base.plan(layer, x))
        assert not fresh and torch.equal(out, layer(x))


def test_held_weight_refused_after_a_write_and_dropped_after_a_failed_call(on_cpu, monkeypatch):
    """The dense weight a 4-bit forward holds for the miss is refused once the packed weight is written in place
    (a new version), and nothing stays held after a layer call that raised past the base result (as checkpointing's
    early stop does)."""

    model = qdora_model()
    flashdora.enable(model)
    model.eval()
    base = _bases(model)[0]
    with torch.no_grad():
        x = torch.randn(2, 8, base.in_features)
        _, fresh = bnb_base.run(base, x, bnb_base.plan(base, x))
        packed, state = base.weight.detach(), base.weight.quant_state
        kept = bnb_dequant.kept_dense(packed, state)
        assert fresh and torch.equal(kept, bnb.functional.dequantize_4bit(packed, state))
        base.weight.add_(0)
        assert bnb_dequant.kept_dense(packed, state) is None
    monkeypatch.setattr(flashdora.peft.variant, "flash_forward", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError), torch.no_grad():
        model(input_ids=make_ids(256))
    assert flashdora.stats().get("base:4bit", 0) > 0 and bnb_dequant._dense is None


def _enabled_eval_twice(model):
    """``model`` enabled, then two eval forwards (the first call of an 8-bit layer is its own) on fresh counters."""
    flashdora.enable(model)
    model.eval()
    flashdora.reset_stats()
    with torch.no_grad():
        model(input_ids=make_ids(256))
        model(input_ids=make_ids(256))


def test_private_apis_off_keeps_the_layers_own_call(on_cpu, monkeypatch):
    """``FLASHDORA_PRIVATE_APIS=0`` (the switch for every private internal): both kinds run the layers' own calls."""
    monkeypatch.setenv("FLASHDORA_PRIVATE_APIS", "0")
    for model in (qdora_model(), int8_bf16_model()):
        _enabled_eval_twice(model)
        assert not any(k.startswith("base:") for k in flashdora.stats())
    monkeypatch.setenv("FLASHDORA_PRIVATE_APIS", "1")
    flashdora.reset_stats()
    with torch.no_grad():
        model(input_ids=make_ids(256))
    assert flashdora.stats()["base:8bit"] == len(_int8_bases(model))


def test_peft_bnb_class_enable_disable_patch_and_pickle(on_cpu, unpatched):  # noqa: F811
    """``enable`` re-classes PEFT's ``lora.bnb.Linear4bit`` layers (printed as PEFT's), ``disable`` restores them;
    ``patch_peft`` gives PEFT's class flashdora's forward and ``unpatch_peft`` its own back; the class pickles by
    name. (A whole bitsandbytes model does not round-trip through ``torch.save``, PEFT's own neither: its weights
    lose their quantization state.)"""
    model = qdora_model(peft_bnb=True)
    peft_cls = peft_layers.peft_class("Linear4bit")
    layers = [m for m in model.modules() if type(m) is peft_cls]
    assert len(layers) == len(_bases(model))
    flashdora.enable(model)
    assert all(type(m) is peft_layers.FlashDoraLinear4bit for m in layers)
    assert "lora.Linear4bit(" in repr(layers[0])
    ids = make_ids(256)
    assert pickle.loads(pickle.dumps(type(layers[0]))) is peft_layers.FlashDoraLinear4bit  # (found by name)
    flashdora.disable(model)
    assert all(type(m) is peft_cls for m in layers)
    forward = peft_cls.__dict__["forward"]
    flashdora.patch_peft()
    assert peft_cls.__dict__["forward"] is peft_layers._lean_forward_bnb
    flashdora.reset_stats()
    fresh = qdora_model(peft_bnb=True)
    fresh.eval()
    with torch.no_grad():
        fresh(input_ids=ids)
    assert flashdora.stats().get("base:4bit", 0) == len(_bases(fresh))
    flashdora.unpatch_peft()
    assert peft_cls.__dict__["forward"] is forward


def _int8_bases(model):
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]


def _int8_twins(threshold, **kwargs):
    """An enabled ``int8_bf16_model(**kwargs)`` with outlier ``threshold`` on its layers, and a copy of it."""
    model = int8_bf16_model(**kwargs)
    for layer in _int8_bases(model):
        layer.state.threshold = threshold
    flashdora.enable(model)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("threshold", [0.0, 2.0], ids=["threshold-0", "outliers"])
@pytest.mark.parametrize("peft_class", [False, True], ids=["peft-linear", "peft-bnb-class"])
def test_int8_base_result_is_the_layers_own_bit_for_bit(peft_class, threshold, monkeypatch):
    """An 8-bit layer: eval logits, and logits and gradients of two backwards in eval mode (bitsandbytes' CPU backend
    trains through another function, ``MatMul8bitFp``; eval mode takes ``MatMul8bitLt``, the one CUDA trains with) are
    the same bits with flashdora's base result and the layer's own call, at threshold 0 and with an outlier threshold
    (bitsandbytes' mixed product; 2.0 here so that a tiny model's normalized inputs have outlier columns). The
    layer's first call takes the shortcut too (flashdora moves the int8 weight into the state as the layer's first
    call does); in training mode on the CPU every call is the layer's own."""
    model, twin = _int8_twins(threshold, peft_bnb=peft_class)
    runs = []
    for fast, m in [(True, model), (False, twin)]:
        monkeypatch.setattr(bnb_base, "DEVICES", ("cuda", "cpu") if fast else ("cuda",))
        flashdora.reset_stats()
        m.eval()
        out = []
        for step in range(3):
            m.zero_grad(set_to_none=True)
            logits = m(input_ids=make_ids(256, step), labels=make_ids(256, step)).logits
            logits.float().square().mean().backward()
            out += [logits.detach(), *(p.grad for p in m.parameters() if p.requires_grad)]
        out += [layer.state.idx for layer in _int8_bases(m)] if threshold else []
        runs.append(out)
        n_fast = flashdora.stats().get("base:8bit", 0)
        assert n_fast == (3 * len(_int8_bases(m)) if fast else 0)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not threshold or any(layer.state.idx.numel() for layer in _int8_bases(model))  # outliers were there
    monkeypatch.setattr(bnb_base, "DEVICES", ("cuda", "cpu"))
    flashdora.reset_stats()
    train_step(model, make_ids(256))
    assert "base:8bit" not in flashdora.stats()


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_cuda_takes_the_path_past_the_fused_kernels_cutoff_only(autocast, monkeypatch):
    """On CUDA (PEFT's ``lora.bnb`` class, bf16 compute, the C++ dequantization): past 1536 rows the base result is
    flashdora's and every logit and gradient is the layer's own bit for bit; at 16 rows bitsandbytes' fused kernel
    runs (the layer's own call)."""
    from flashdora import native

    assert native.load() is not None
    model = bf16_model(device="cuda", peft_bnb=True)
    flashdora.enable(model)
    twin = copy.deepcopy(model)
    for tokens, taken in [((2, 1024), True), ((1, 16), False)]:
        ids = torch.randint(0, 256, tokens, generator=torch.Generator().manual_seed(0)).cuda()
        runs = []
        for fast, m in [(True, model), (False, twin)]:
            monkeypatch.setattr(bnb_base, "DEVICES", ("cuda",) if fast else ())
            flashdora.reset_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                _, logits, grads = train_step(m, ids)
            runs.append([logits, *grads.values()])
            assert flashdora.stats().get("base:4bit", 0) == (len(_bases(m)) if fast and taken else 0)
        assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_patch_peft_before_any_enable_then_unpatch(monkeypatch, unpatched):  # noqa: F811
    """``patch_peft`` as the first call (nothing kept yet): ``unpatch_peft`` gives PEFT's class its own forward."""
    monkeypatch.setattr(peft_layers, "_peft_forwards", {})
    classes = [peft_layers.peft_class(kind, load=True) for kind in peft_layers.KINDS]
    forwards = [cls.__dict__["forward"] for cls in classes]
    flashdora.patch_peft()
    assert all(cls.__dict__["forward"] is peft_layers._lean_forward_bnb for cls in classes)
    flashdora.unpatch_peft()
    assert [cls.__dict__["forward"] for cls in classes] == forwards
    assert not any("_flashdora_kind" in cls.__dict__ for cls in classes)


@pytest.mark.gpu
@pytest.mark.parametrize("threshold", [0.0, 2.0], ids=["threshold-0", "outliers"])
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
@pytest.mark.parametrize("peft_class", [False, True], ids=["peft-linear", "peft-bnb-class"])
def test_cuda_int8_training_bit_for_bit(autocast, peft_class, threshold, monkeypatch):
    """On CUDA an 8-bit layer's base result is flashdora's from its first call on (flashdora does bitsandbytes'
    first-call work itself), in training, and every logit and gradient of two training steps is the layer's own bit
    for bit, at threshold 0 and with outlier columns."""
    model, twin = _int8_twins(threshold, device="cuda", peft_bnb=peft_class)
    runs = []
    for fast, m in [(True, model), (False, twin)]:
        monkeypatch.setattr(bnb_base, "DEVICES", ("cuda",) if fast else ())
        flashdora.reset_stats()
        out = []
        for step in range(2):
            ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(step)).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                _, logits, grads = train_step(m, ids)
            out += [logits, *grads.values()]
        runs.append(out)
        assert flashdora.stats().get("base:8bit", 0) == (2 * len(_int8_bases(m)) if fast else 0)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("make", [qdora_model, int8_bf16_model], ids=["nf4", "int8"])
def test_dispatch_decides_the_base_once_per_call_and_the_route_records_it(on_cpu, monkeypatch, make):
    """Each layer call asks ``dispatch.base_plan`` once, before its base runs, and the route records what it decided:
    ``bnb`` where it planned bitsandbytes' ops, ``layer`` (the layer's own call) where it did not."""
    from flashdora import dispatch

    model = make()
    flashdora.enable(model)
    model.eval()
    real = dispatch.base_plan
    for planned in (True, False):
        calls = []

        def base_plan(base, x, native, calls=calls, planned=planned):
            calls.append(base)
            return real(base, x, native) if planned else None

        monkeypatch.setattr(dispatch, "base_plan", base_plan)
        with torch.no_grad():
            model(input_ids=make_ids(256))
        layers = [m for m in model.modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt")]
        assert len(calls) == len(layers) and {id(b) for b in calls} == {id(b) for b in layers}
        routes = [m.__dict__["_flashdora_routes"]["default"] for m in model.modules() if hasattr(m, "base_layer")]
        assert len(routes) == len(layers) and {r.base for r in routes} == {"bnb" if planned else "layer"}
