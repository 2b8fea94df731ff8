"""A base weight that is trained, frozen and unfrozen in any order never gets a stale ``||W||^2`` from the norm cache.

The cache keeps ``||W||^2`` across optimizer steps so that a frozen base computes it once. Fused optimizers write
parameters without moving their version counters, so what tells the cache that a step wrote W is the step's stamp
on W's storage (``norm_cache._count_step``), or for a W that requires a gradient at the forward or carries an
optimizer wrapper's gradient hook any step at all (a wrapper stepping its own copies writes W back with neither). Each
scenario ends with the enabled model's output compared with itself with the cache off and with PEFT on the same
weights.
"""

import copy

import pytest
import torch

import flashdora
from flashdora.ops import norm_cache
from flashdora.tools.demo import build_peft_model
from tests.ops.test_norm_cache import _ids, _logits_without_cache

N_LAYERS = 14  # tiny Llama: 2 layers x 7 projections


class DataSGD(torch.optim.Optimizer):
    """SGD that writes through ``p.data``: the version counter stays where it was, as after a fused kernel's write."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def _fused_adamw(params):
    return torch.optim.AdamW(params, lr=0.05, fused=True)


OPTIMIZERS = [
    pytest.param(_fused_adamw, id="fused-adamw"),
    pytest.param(lambda params: DataSGD(params, lr=5.0), id="data-sgd"),
]


def _model():
    model = build_peft_model("tiny", 4, 0.0, "cpu", seed=4)
    model.base_model.model.config.use_cache = False
    return flashdora.enable(model)


def _bases(model):
    """The base weights of the DoRA layers."""
    return [m.get_base_layer().weight for m in model.modules() if hasattr(m, "lora_magnitude_vector")]


def _set_trainable(params, trainable: bool):
    for p in params:
        p.requires_grad_(trainable)


def _forward(model, ids, backward):
    model.train()
    out = model(input_ids=ids, labels=ids)
    if backward:
        out.loss.backward()


def _check(model, ids, monkeypatch, what):
    """The enabled model's output equals its output without the cache and PEFT's on the same weights."""
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits
        peft_out = flashdora.disable(copy.deepcopy(model))(input_ids=ids).logits
    fresh = _logits_without_cache(model, ids, monkeypatch)
    torch.testing.assert_close(out, fresh, rtol=1e-6, atol=1e-6, msg=f"cached vs no cache, {what}")
    torch.testing.assert_close(out, peft_out, rtol=1e-5, atol=1e-5, msg=f"vs PEFT, {what}")


def _train_then_freeze(model, opt, bases, ids):
    """W trainable in the forward, stepped, then frozen (``_steps`` at 0: the process's first step)."""
    _set_trainable(bases, True)
    _forward(model, ids, backward=True)
    opt.step()
    _set_trainable(bases, False)


def _freeze_before_step(model, opt, bases, ids):
    """A forward with W frozen, one with W trainable, then W frozen again before the step (its gradient stays, so the
    step writes it: a weight in the optimizer with ``requires_grad`` off)."""
    _forward(model, ids, backward=False)
    _set_trainable(bases, True)
    _forward(model, ids, backward=True)
    _set_trainable(bases, False)
    opt.step()


def _step_between_forwards(model, opt, bases, ids):
    """Unfreeze, step (a gradient from elsewhere), freeze, with no forward between."""
    _forward(model, ids, backward=False)
    _set_trainable(bases, True)
    for i, p in enumerate(bases):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
    opt.step()
    _set_trainable(bases, False)


SCENARIOS = [
    pytest.param(_train_then_freeze, id="train-then-freeze"),
    pytest.param(_freeze_before_step, id="freeze-before-step"),
    pytest.param(_step_between_forwards, id="unfreeze-step-freeze"),
]


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_base_weight_stepped_and_frozen_is_never_stale(scenario, make_optimizer, monkeypatch):
    monkeypatch.setattr(norm_cache, "_steps", 0)
    model = _model()
    bases = _bases(model)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad] + bases)
    ids = _ids(1)
    before = [(p.detach().clone(), p._version) for p in bases]
    scenario(model, opt, bases, ids)
    for p, (values, version) in zip(bases, before):
        assert not torch.equal(p, values) and p._version == version  # the step wrote W, behind its version counter
    _check(model, ids, monkeypatch, scenario.__name__)


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS)
@pytest.mark.parametrize("in_optimizer", [True, False], ids=["base-in-optimizer", "base-not-in-optimizer"])
def test_a_base_frozen_throughout_computes_its_square_once(in_optimizer, make_optimizer, monkeypatch):
    """The normal PEFT case: ``||W||^2`` once per layer over many steps, also when the frozen base is handed to the
    optimizer (``AdamW(model.parameters())``), while the norm is recomputed after each step."""
    model = _model()
    params = list(model.parameters())
    opt = make_optimizer(params if in_optimizer else [p for p in params if p.requires_grad])
    flashdora.reset_stats()
    for step in range(3):
        ids = _ids(10 + step)
        _forward(model, ids, backward=True)
        opt.step()
        opt.zero_grad()
        _check(model, ids, monkeypatch, f"step {step}")
    counts = flashdora.stats()
    assert counts["norm:base_sq"] == N_LAYERS, counts
    assert counts["norm:eager"] >= 4 * N_LAYERS, counts  # a norm per step (and the uncached twins' own)


class MasterCopyAdamW:
    """An optimizer wrapper as DeepSpeed ZeRO-1/2 is one: ``torch.optim.AdamW`` steps float32 master copies, and the
    wrapper writes them back into the parameters below autograd (no stamp on their storage, no version bump)."""

    def __init__(self, params, as_deepspeed: bool = False):
        self.params = list(params)
        self.masters = [p.detach().clone().requires_grad_(True) for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, lr=0.05)
        self.as_deepspeed = as_deepspeed
        if as_deepspeed:  # DeepSpeed ZeRO's gradient hook on each parameter it holds (removed only with the wrapper)
            self.hooks = [p.register_post_accumulate_grad_hook(lambda p: None) for p in self.params]

    def step(self):
        for p, master in zip(self.params, self.masters):
            # (DeepSpeed's flat master partitions: a parameter frozen since has a zero gradient, stepped all the same)
            zero = torch.zeros_like(master) if self.as_deepspeed else None
            master.grad = zero if p.grad is None else p.grad.detach().clone()
        self.inner.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                p.data.copy_(master)


def _steps_behind_the_version_counter(model, bases, opt, monkeypatch, seed: int) -> None:
    """Two training steps through ``opt``, each writing every base weight behind its version counter, each followed
    by ``_check``."""
    for step in range(2):
        ids = _ids(seed + step)
        before = [(p.detach().clone(), p._version) for p in bases]
        _forward(model, ids, backward=True)
        opt.step()
        model.zero_grad()
        for p, (values, version) in zip(bases, before):
            assert not torch.equal(p, values) and p._version == version  # written behind the version counter
        _check(model, ids, monkeypatch, f"step {step}")


def test_a_trainable_base_stepped_through_a_master_copy_is_never_stale(monkeypatch):
    """A base weight trained through an optimizer that steps copies of the parameters (DeepSpeed ZeRO-1/2 does):
    what the step wrote reaches the next forward, since any step may have written a weight that requires a gradient."""
    model = _model()
    bases = _bases(model)
    _set_trainable(bases, True)
    opt = MasterCopyAdamW([p for p in model.parameters() if p.requires_grad])
    _steps_behind_the_version_counter(model, bases, opt, monkeypatch, seed=20)


def test_a_base_frozen_after_a_wrapper_took_it_is_never_stale(monkeypatch):
    """A base weight trainable when an optimizer wrapper took it (``deepspeed.initialize`` with ZeRO-1/2/3) and frozen
    before any forward: the wrapper keeps stepping its master copy (weight decay on a zero gradient) and writing it
    back, and the parameter never requires a gradient in a forward. The gradient hook the wrapper left on it says
    so: any step may have written it (``norm_cache._last_step``)."""
    model = _model()
    bases = _bases(model)
    _set_trainable(bases, True)
    opt = MasterCopyAdamW([p for p in model.parameters() if p.requires_grad], as_deepspeed=True)
    _set_trainable(bases, False)
    for group in opt.inner.param_groups:
        group["weight_decay"] = 2.0
    _steps_behind_the_version_counter(model, bases, opt, monkeypatch, seed=30)


def test_a_compiled_lookup_reads_the_base_weights_own_flags():
    """Under ``torch.compile`` the cache gets a detached alias of the base weight (``dora_scales_op``), without the
    ``requires_grad`` and gradient hooks that say which steps may write it: it reads them on the layer's own weight.
    A base frozen after an optimizer wrapper took it, written behind its version counter, then any step: the next
    compiled lookup computes ``||W||^2`` again and gives the fresh scales."""
    model = _model()
    layer = next(m for m in model.modules() if hasattr(m, "lora_magnitude_vector"))
    owner, base = layer.lora_magnitude_vector["default"], layer.get_base_layer().weight
    base.requires_grad_(True)
    base.register_post_accumulate_grad_hook(lambda p: None)  # as DeepSpeed's ZeRO optimizers do
    base.requires_grad_(False)
    parts = (layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach(), owner.weight.detach())
    scaling = layer.scaling["default"]

    def compiled_lookup():
        return norm_cache.dora_scales_op(base.detach(), *parts, scaling, owner._flashdora_cache_id)

    compiled_lookup()
    with torch.no_grad():
        base.data.mul_(0.5)  # the wrapper's write-back: no version bump, no stamp
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()  # a step of any optimizer
    flashdora.reset_stats()
    got = compiled_lookup()
    assert flashdora.stats().get("norm:base_sq") == 1
    torch.testing.assert_close(got, norm_cache._uncached(base.detach(), *parts, scaling), rtol=1e-6, atol=1e-6)
