"""Every route that changes a DoRA layer's weights, scaling or adapters reaches flashdora's norm cache.

After each route an enabled model's output (and, in training, every gradient) equals (a) the same model with the
cache off (``FLASHDORA_NORM_CACHE=0``) and (b) a PEFT twin, a copy made before ``enable`` that took the same route
(the harness: tests/cache_helpers.py). The one blind spot is a write by hand that bypasses autograd's version counter
(``p.data.copy_``), which ``flashdora.invalidate`` answers; PEFT's hotswap writes through ``.data`` too, and must be
seen without it. The routes one by one (``test_route``), then random sequences of them (``test_random_routes``); the
crashes reported against the cache are in tests/test_cache_crashes.py.
"""

import functools
import os

import peft
import pytest
import torch
from packaging.version import Version
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from peft.utils import hotswap
from torch import nn
from torch.nn.utils import parametrize

import flashdora
from tests.cache_helpers import Pair, _adapter_keys, _all_lora_layers, _check, _layer_names, _owners, _pair
from tests.helpers import rel_err
from tests.peft_models import unpatched  # noqa: F401 - the autouse fixture: PEFT runs its own code here

# The routes: each takes the same step on the twin and on the model


OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=0.02)), "sgd": (torch.optim.SGD, dict(lr=0.5, momentum=0.9))}
FLAVORS = {"loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


@functools.cache
def _runs(optimizer: str, flavor: str) -> bool:
    """Whether this build's ``optimizer`` runs in ``flavor`` on the CPU (fused kernels came to the CPU late)."""
    cls, kwargs = OPTIMIZERS[optimizer]
    p = nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    try:
        cls([p], **kwargs, **FLAVORS[flavor]).step()
    except (RuntimeError, ValueError):
        return False
    return True


def _optimizer_step(optimizer: str, flavor: str):
    def route(pair):
        if not _runs(optimizer, flavor):
            pytest.skip(f"{optimizer} ({flavor}) does not run on this build")
        ids, seed = pair.ids(), pair.seed()
        twin, model = pair.both()
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        model(input_ids=ids, labels=ids).loss.backward()
        twin_params = dict(twin.named_parameters())  # the same gradients, so both take exactly the same step
        for name, p in model.named_parameters():
            twin_params[name].grad = None if p.grad is None else p.grad.clone()
        cls, kwargs = OPTIMIZERS[optimizer]
        for m in (twin, model):
            cls([p for p in m.parameters() if p.requires_grad], **kwargs, **FLAVORS[flavor]).step()
            m.zero_grad(set_to_none=True)

    return route


def _in_place(kind, edit):
    def route(pair):
        owners = _owners(pair, kind)
        noise = pair.like(getattr(*owners[0]), 0.01)
        for module, attr in owners:
            with torch.no_grad():
                edit(getattr(module, attr), noise)

    return route


def _load_state_dict(pair):
    factor = 1 + 0.2 * pair.rng.random()
    sd = {k: v * factor if "lora_" in k else v.clone() for k, v in pair.twin.state_dict().items()}
    for model in pair.both():
        model.load_state_dict(sd)


def _load_state_dict_assign(pair):
    factor = 1 + 0.2 * pair.rng.random()
    sd = {k: v * factor for k, v in pair.twin.state_dict().items() if "lora_" in k}
    for model in pair.both():
        model.load_state_dict({k: v.clone() for k, v in sd.items()}, strict=False, assign=True)


def _new_parameter(pair):
    owners = _owners(pair, pair.rng.choice(["lora_A", "lora_B", "magnitude"]))
    old = getattr(*owners[0])
    new = old.detach() * (1 + pair.like(old, 0.2))
    for module, attr in owners:
        setattr(module, attr, nn.Parameter(new.clone(), requires_grad=old.requires_grad))


def _swap_tensors(pair):
    owners = _owners(pair)
    old = getattr(*owners[0])
    new = old.detach() * (1 + pair.like(old, 0.2))
    for module, attr in owners:
        torch.utils.swap_tensors(getattr(module, attr), nn.Parameter(new.clone(), requires_grad=old.requires_grad))


def _to_float64_and_back(swap: bool):
    def route(pair):
        was = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(swap)
        try:
            for model in pair.both():
                model.to(torch.float64)
            if not _triton():  # (the Triton path refuses float64 by design)
                _check(pair, "in float64")
            for model in pair.both():
                model.to(torch.float32)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(was)

    return route


def _triton() -> bool:
    return os.environ.get("FLASHDORA_BACKEND") == "triton"


def _functional_call(pair):
    picked = pair.rng.sample(_adapter_keys(pair.model, pair.adapter), 3)
    current = pair.twin.state_dict()
    params = {k: current[k] * (1 + pair.like(current[k], 0.3)) for k in picked}
    _check(pair, f"functional_call with new {', '.join(k.split('.', 3)[-1] for k in picked)}", params=params)


class _Scale(nn.Module):
    """A parametrization ``w -> factor w`` with a learnable ``factor``."""

    def __init__(self):
        super().__init__()
        self.factor = nn.Parameter(torch.tensor(1.25))

    def forward(self, w):
        return w * self.factor


def _parametrize(pair):
    name = pair.rng.choice(_layer_names(pair.model, pair.adapter))
    modules = [m.get_submodule(name).lora_B[pair.adapter] for m in pair.both()]
    if not parametrize.is_parametrized(modules[0], "weight"):
        for module in modules:
            parametrize.register_parametrization(module, "weight", _Scale())
        _check(pair, f"parametrized {name}")
    factor = 1 + pair.rng.random()
    for module in modules:
        with torch.no_grad():
            module.parametrizations.weight[0].factor.mul_(factor)


def _vector_to_parameters(pair):
    keys = _adapter_keys(pair.model, pair.adapter)
    factor = 1 + 0.2 * pair.rng.random()
    vec = nn.utils.parameters_to_vector([pair.twin.get_parameter(k) for k in keys]).detach() * factor
    for model in pair.both():
        nn.utils.vector_to_parameters(vec.clone(), [model.get_parameter(k) for k in keys])


def _set_adapter(pair):
    pair.adapter = "other" if pair.adapter == "default" else "default"
    for model in pair.both():
        model.set_adapter(pair.adapter)


def _set_scale(pair):
    scale = pair.rng.uniform(0.5, 2.0)
    for model in pair.both():
        for layer in _all_lora_layers(model):
            layer.set_scale(pair.adapter, scale)


def _scale_and_unscale(pair):
    factor = pair.rng.uniform(1.5, 2.5)
    unscale = pair.rng.choice([None, factor])
    for model in pair.both():
        for layer in _all_lora_layers(model):
            layer.scale_layer(factor)
    _check(pair, f"scale_layer({factor:.2f})")
    for model in pair.both():
        for layer in _all_lora_layers(model):
            layer.unscale_layer(unscale)


def _merge_and_unmerge(pair):
    for model in pair.both():
        model.merge_adapter()
    _check(pair, "merged")
    for model in pair.both():
        model.unmerge_adapter()


def _invalidate(pair):
    """``flashdora.invalidate``, the documented remedy for writes the version counters miss."""
    invalidate = getattr(flashdora, "invalidate", None)
    if invalidate is None:
        pytest.skip("flashdora.invalidate is not there yet")
    invalidate(pair.model) if pair.rng.random() < 0.5 else invalidate()


def _hotswap(pair):
    """PEFT's hotswap writes same-shaped weights through ``.data``, where no version counter moves; flashdora must see
    it all the same (the function is looked up at call time: ``import flashdora`` may have wrapped it)."""
    factor = 1 + 0.3 * pair.rng.random()
    sd = {k: pair.twin.state_dict()[k] * factor for k in _adapter_keys(pair.model, pair.adapter)}
    for model in pair.both():
        hotswap.hotswap_adapter_from_state_dict(
            model, {k: v.clone() for k, v in sd.items()}, adapter_name=pair.adapter,
            config=model.peft_config[pair.adapter],
        )  # fmt: skip


def _set_peft_model_state_dict(pair):
    factor = 1 + 0.3 * pair.rng.random()
    sd = get_peft_model_state_dict(pair.twin, adapter_name=pair.adapter)
    sd = {k: v * factor for k, v in sd.items() if "parametrizations" not in k}
    for model in pair.both():
        set_peft_model_state_dict(model, {k: v.clone() for k, v in sd.items()}, adapter_name=pair.adapter)


def _readd_adapter(pair):
    """Delete the second adapter, add it again with new weights (new owner objects, maybe at old addresses),
    ``enable`` again, and make it the active one."""
    if pair.adapter == "other":
        _set_adapter(pair)
    seed = pair.seed()
    for model in pair.both():
        model.delete_adapter("other")
        torch.manual_seed(seed)
        model.add_adapter("other", pair.other)
    flashdora.enable(pair.model)
    twin_sd, model_sd = (m.state_dict() for m in pair.both())
    assert all(torch.equal(twin_sd[k], model_sd[k]) for k in twin_sd if ".other." in k)  # the twin keeps up
    _set_adapter(pair)


def _data_copy(pair):
    """``p.data.copy_(...)``: invisible to version counters, hence ``flashdora.invalidate`` after it."""
    owners = _owners(pair)
    old = getattr(*owners[0])
    new = old.detach() * (1 + pair.like(old, 0.2))
    for module, attr in owners:
        getattr(module, attr).data.copy_(new)
    _invalidate(pair)


# name -> (route, whether it changes the output: if it does, a stale norm would show)
ROUTES = {
    **{f"{o}-{f}": (_optimizer_step(o, f), True) for o in OPTIMIZERS for f in FLAVORS},
    "mul_-lora_B": (_in_place("lora_B", lambda t, noise: t.mul_(1.5)), True),
    "add_-magnitude": (_in_place("magnitude", lambda t, noise: t.add_(0.1)), True),
    "add_-base": (_in_place("base", lambda t, noise: t.add_(noise)), True),
    "load_state_dict": (_load_state_dict, True),
    "load_state_dict-assign": (_load_state_dict_assign, True),
    "new-parameter": (_new_parameter, True),
    "swap_tensors": (_swap_tensors, True),
    "float64-and-back-swapping": (_to_float64_and_back(swap=True), False),
    "float64-and-back": (_to_float64_and_back(swap=False), False),
    "functional_call": (_functional_call, False),
    "parametrization": (_parametrize, True),
    "vector_to_parameters": (_vector_to_parameters, True),
    "set_adapter": (_set_adapter, True),
    "set_scale": (_set_scale, True),
    "scale_layer-unscale_layer": (_scale_and_unscale, False),
    "merge-unmerge": (_merge_and_unmerge, False),
    "hotswap": (_hotswap, True),
    "set_peft_model_state_dict": (_set_peft_model_state_dict, True),
    "delete-add-adapter": (_readd_adapter, True),
    "data.copy_+invalidate": (_data_copy, True),
}


# PEFT before 0.21 fails these routes itself (its twin, which runs first): unmerging DoRA on Conv1D raises a shape
# error, and a hotswap after ``swap_tensors`` leaves parameters that no longer require grad. CI runs this file
# against the oldest supported PEFT too (scripts/test_oldest.sh).
OLD_PEFT = Version(peft.__version__) < Version("0.21")


def _peft_takes(name: str, model_name: str) -> bool:
    return not OLD_PEFT or (name != "hotswap" and (name, model_name) != ("merge-unmerge", "gpt2"))


def _take(pair: Pair, name: str):
    pair.history.append(name)
    ROUTES[name][0](pair)


# Under Triton (interpreted: slow) the routes that hand a layer new tensor objects or a new scaling, which the Triton
# path once held on to across steps (its per-step norm group, at 3f86b3e)
TRITON_ROUTES = [("delete-add-adapter", "llama"), ("new-parameter", "llama"), ("parametrization", "llama"),
                 ("set_scale", "llama")]  # fmt: skip
ROUTE_CASES = [
    pytest.param(
        name, model_name, backend, id=f"{name}-{model_name}-{backend}",
        marks=[] if _peft_takes(name, model_name) else pytest.mark.skip(reason=f"PEFT {peft.__version__} fails it"),
    )
    for name in sorted(ROUTES)
    for model_name, backend in [("llama", "eager"), ("gpt2", "eager"), ("llama", "triton")]
    if backend == "eager" or (name, model_name) in TRITON_ROUTES
]  # fmt: skip


@pytest.mark.parametrize("name,model_name,backend", ROUTE_CASES)
def test_route(name, model_name, backend, monkeypatch):
    """One route after an optimizer step and a training and an eval forward (the cache is full), then a forward in
    every mode."""
    pair = _pair(model_name, 0, monkeypatch, backend)
    ids = pair.ids()
    _take(pair, "adamw-loop")
    _check(pair, "warm-up", "train")
    before = _check(pair, "warm-up", "no_grad", ids=ids)
    _take(pair, name)
    _check(pair, f"after {name}", "train")
    after = _check(pair, f"after {name}", "no_grad", ids=ids)
    if ROUTES[name][1]:
        assert rel_err(after, before) > 1e-3, f"{name} must change the output, or a stale norm could not show"
    _check(pair, f"after {name}", "inference_mode")


RANDOM_STEPS = {"eager": 25, "triton": 12}  # (the Triton interpreter is slow)
RANDOM_RUNS = [
    pytest.param("eager", "llama", 0, id="eager-llama-0"),
    pytest.param("eager", "llama", 1, id="eager-llama-1"),
    pytest.param("eager", "gpt2", 2, id="eager-gpt2-2"),
    pytest.param("eager", "gpt2", 3, id="eager-gpt2-3"),
    pytest.param("triton", "gpt2", 0, id="triton-gpt2-0"),
    pytest.param("triton", "llama", 1, id="triton-llama-1"),
]


@pytest.mark.parametrize("backend,model_name,seed", RANDOM_RUNS)
def test_random_routes(backend, model_name, seed, monkeypatch):
    """Random routes, each followed by a forward in a random mode (eval under no_grad or inference_mode, or a
    training forward and backward), compared with the same model without the cache and with the PEFT twin."""
    pair = _pair(model_name, seed, monkeypatch, backend)
    names = sorted(ROUTES)
    if getattr(flashdora, "invalidate", None) is None:
        names = [n for n in names if "invalidate" not in n]
    names = [n for n in names if n.split("-")[-1] not in FLAVORS or _runs(*n.split("-"))]
    names = [n for n in names if _peft_takes(n, model_name)]
    for step in range(RANDOM_STEPS[backend]):
        name = pair.rng.choice(names)
        try:
            _take(pair, name)
            _check(pair, f"step {step}, after {name}")
        except Exception as e:
            if hasattr(e, "add_note"):  # (Python 3.11+)
                e.add_note(f"random run {backend}/{model_name}/{seed}: step {step}, routes {pair.history}")
            raise
