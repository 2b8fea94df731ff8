"""Every route that changes a DoRA layer's weights, scaling or adapters reaches flashdora's norm cache.

After each route an enabled model's output (and, in training, every gradient) equals (a) the same model with the
cache off (``FLASHDORA_NORM_CACHE=0``) and (b) a PEFT twin, a copy made before ``enable`` that took the same route.
The one blind spot is a write by hand that bypasses autograd's version counter (``p.data.copy_``), which
``flashdora.invalidate`` answers; PEFT's hotswap writes through ``.data`` too, and must be seen without it. Then one
deterministic test per crash reported against the cache.
"""

import copy
import functools
import io
import os
import random
import warnings
from dataclasses import dataclass, field

import peft
import pytest
import torch
from packaging.version import Version
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora.layer import LoraLayer
from peft.utils import hotswap
from torch import nn
from torch.nn.utils import parametrize
from transformers import GPT2Config, GPT2LMHeadModel

import flashdora
from flashdora.demo import SIZES
from flashdora.reference import dora_linear_ref
from tests.helpers import RTOL, dora_inputs, rel_err
from tests.peft_models import unpatched  # noqa: F401 - the autouse fixture: PEFT runs its own code here

OUT_RTOL = RTOL[torch.float32]
GRAD_RTOL = 1e-4
MODES = ("no_grad", "inference_mode", "train")
ADAPTERS = {"llama": ["q_proj", "down_proj"], "gpt2": ["c_attn"]}  # the second adapter's targets


@dataclass
class Pair:
    """An enabled model, its PEFT twin, and what a route needs: the active adapter, randomness, the history."""

    model: nn.Module
    twin: nn.Module
    vocab: int
    other: LoraConfig
    rng: random.Random
    monkeypatch: pytest.MonkeyPatch
    adapter: str = "default"
    history: list = field(default_factory=list)

    def both(self):
        return self.twin, self.model  # the twin first: a route PEFT itself cannot take fails before flashdora's

    def seed(self) -> int:
        return self.rng.randrange(2**31)

    def like(self, t: torch.Tensor, scale=1.0) -> torch.Tensor:
        """Seeded random values shaped like ``t`` (the same for both models)."""
        g = torch.Generator().manual_seed(self.seed())
        return scale * torch.randn(t.shape, generator=g, dtype=t.dtype)

    def ids(self) -> torch.Tensor:
        return torch.randint(0, self.vocab, (2, 8), generator=torch.Generator().manual_seed(self.seed()))


def _llama(seed: int, small: bool, targets=None):
    """The demo's tiny Llama (``build_peft_model("tiny", ...)``) with DoRA at rank 4 on ``targets`` (default: every
    projection); ``small``: one block, DoRA on three projections."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, blocks, inter, heads, kv, vocab = SIZES["tiny"]
    config = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=1 if small else blocks, intermediate_size=inter,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=64,
        use_cache=False,
    )  # fmt: skip
    if targets is None:
        targets = ["q_proj", "v_proj", "down_proj"] + ([] if small else ["k_proj", "o_proj", "gate_proj", "up_proj"])
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, use_dora=True, target_modules=targets, init_lora_weights=False
    )
    torch.manual_seed(seed)
    return get_peft_model(LlamaForCausalLM(config), lora)


def _gpt2(seed: int, small: bool):
    """``tests/peft_models.gpt2`` (``Conv1D`` layers, ``fan_in_fan_out``); ``small``: one block."""
    torch.manual_seed(seed)
    config = GPT2Config(n_embd=32, n_layer=1 if small else 2, n_head=4, vocab_size=97, n_positions=64, use_cache=False)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, use_dora=True, fan_in_fan_out=True,
        target_modules=["c_attn", "c_proj", "c_fc"], init_lora_weights=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(GPT2LMHeadModel(config), lora)


def _pair(name: str, seed: int, monkeypatch, backend: str = "eager") -> Pair:
    """A Llama (``nn.Linear``) or GPT-2 (``Conv1D``) with two DoRA adapters, enabled, and its PEFT twin; smaller
    under Triton (interpreted on the CPU: slow)."""
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    small = backend == "triton"
    model, vocab = (_llama(seed, small), SIZES["tiny"][5]) if name == "llama" else (_gpt2(seed, small), 97)
    other = LoraConfig(
        r=2, lora_alpha=4, use_dora=True, target_modules=ADAPTERS[name], fan_in_fan_out=name == "gpt2",
        init_lora_weights=False,
    )  # fmt: skip
    torch.manual_seed(seed + 1)
    model.add_adapter("other", other)
    twin = copy.deepcopy(model)
    return Pair(flashdora.enable(model), twin, vocab, other, random.Random(seed), monkeypatch)


def _forward(model, ids, mode, seed, params=None, backward=True):
    """Logits of one forward in ``mode`` (through ``functional_call`` with ``params``), and in training every
    parameter's gradient (dropout masks from ``seed``)."""

    def call(**kwargs):
        return model(**kwargs) if params is None else torch.func.functional_call(model, params, (), kwargs)

    if mode == "train":
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        if not backward:
            with torch.no_grad():
                return call(input_ids=ids, labels=ids).logits, {}
        out = call(input_ids=ids, labels=ids)
        if out.loss.requires_grad:  # (a merged model uses no trainable parameter)
            out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out.logits.detach(), grads
    model.eval()
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        return call(input_ids=ids).logits.clone(), {}


def _check(pair: Pair, what: str, mode=None, params=None, ids=None):
    """Compare the enabled model in ``mode`` (default: a random one) with itself without the cache and with PEFT."""
    mode = mode or pair.rng.choice(MODES)
    ids = pair.ids() if ids is None else ids
    seed = pair.seed()
    where = f"{what} ({mode}; routes so far: {', '.join(pair.history[-8:])})"
    out, out_grads = _forward(pair.model, ids, mode, seed, params)
    pair.monkeypatch.setenv("FLASHDORA_NORM_CACHE", "0")
    try:
        fresh, _ = _forward(pair.model, ids, mode, seed, params, backward=False)
    finally:
        pair.monkeypatch.delenv("FLASHDORA_NORM_CACHE", raising=False)
    peft_out, peft_grads = _forward(pair.twin, ids, mode, seed, params)
    errs = {"fresh vs PEFT": rel_err(fresh, peft_out), "cached vs PEFT": rel_err(out, peft_out)}
    errs["cached vs fresh"] = rel_err(out, fresh)
    assert max(errs.values()) <= OUT_RTOL, f"{where}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
    assert out_grads.keys() == peft_grads.keys(), where
    for name, peft_grad in peft_grads.items():
        err = rel_err(out_grads[name], peft_grad)
        assert err <= GRAD_RTOL, f"{where}: grad of {name} relative error {err:.1e}"
    return peft_out


# Where a route writes: a DoRA layer's tensors, for the active adapter


def _layer_names(model, adapter):
    return [n for n, m in model.named_modules() if isinstance(m, LoraLayer) and adapter in m.lora_magnitude_vector]


def _owners(pair: Pair, kind=None):
    """One random DoRA layer's ``(module, attribute)`` holding its ``kind`` tensor, in the twin and the model."""
    name = pair.rng.choice(_layer_names(pair.model, pair.adapter))
    kind = kind or pair.rng.choice(["base", "lora_A", "lora_B", "magnitude"])
    owners = []
    for model in pair.both():
        layer = model.get_submodule(name)
        module = {
            "base": layer.get_base_layer(),
            "lora_A": layer.lora_A[pair.adapter],
            "lora_B": layer.lora_B[pair.adapter],
            "magnitude": layer.lora_magnitude_vector[pair.adapter],
        }[kind]
        if parametrize.is_parametrized(module, "weight"):  # the leaf behind the parametrization
            owners.append((module.parametrizations.weight, "original"))
        else:
            owners.append((module, "weight"))
    return owners


def _adapter_keys(model, adapter):
    return [k for k in model.state_dict() if "lora_" in k and f".{adapter}." in k and "parametrizations" not in k]


def _all_lora_layers(model):
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


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
    )  # fmt: skip
    for name in sorted(ROUTES)
    for model_name, backend in [("llama", "eager"), ("gpt2", "eager"), ("llama", "triton")]
    if backend == "eager" or (name, model_name) in TRITON_ROUTES
]


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


# Crashes reported against the cache, one deterministic test each


@pytest.mark.parametrize("then", ["adamw-loop", "merge-unmerge", "load_state_dict", "mul_-lora_B"])
def test_inference_mode_forward_then(then, monkeypatch):
    """Norms cached under ``torch.inference_mode()`` are inference tensors: a later training step (they would be
    saved for backward), a merge, a load or an in-place edit must still work and match PEFT."""
    pair = _pair("llama", 0, monkeypatch)
    _check(pair, "first forward", "inference_mode")
    _take(pair, then)
    _check(pair, f"after {then}", "train")
    _check(pair, f"after {then}", "no_grad")


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(12, 20)
        self.down = nn.Linear(20, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mlp_pair(dtype=torch.float32):
    """A two-layer MLP with DoRA on both layers: enabled, and its PEFT twin."""
    torch.manual_seed(0)
    lora = LoraConfig(r=3, lora_alpha=6, use_dora=True, target_modules=["up", "down"], init_lora_weights=False)
    model = get_peft_model(_MLP().to(dtype), lora)
    twin = copy.deepcopy(model)
    return flashdora.enable(model), twin


def _lora_params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp"])
def test_torch_func_over_lora_parameters(transform, backend, monkeypatch):
    """``torch.func`` transforms of a function of the LoRA parameters run (flashdora may hand them to PEFT's code)
    and give PEFT's numbers."""
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    model, twin = _mlp_pair()
    x = torch.randn(4, 12)
    params = _lora_params(model)
    model(x)  # a cache entry for the real parameters exists

    def run(m):
        if transform == "grad":
            f = lambda ps: torch.func.functional_call(m, ps, (x,)).square().sum()  # noqa: E731
            return torch.func.grad(f)(params)
        if transform == "vmap":
            name = "base_model.model.up.lora_B.default.weight"
            stacked = torch.stack([params[name] * k for k in (0.5, 1.0, 2.0)])
            return {"out": torch.func.vmap(lambda b: torch.func.functional_call(m, {name: b}, (x,)))(stacked)}
        tangents = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, (n, p) in
                    enumerate(params.items())}  # fmt: skip
        out, tangent = torch.func.jvp(lambda ps: torch.func.functional_call(m, ps, (x,)), (params,), (tangents,))
        return {"out": out, "tangent": tangent}

    peft_out = run(twin)
    out = run(model)
    assert out.keys() == peft_out.keys()
    for name, ref in peft_out.items():
        assert rel_err(out[name], ref) <= GRAD_RTOL, f"{transform}: {name} relative error {rel_err(out[name], ref)}"


@pytest.mark.parametrize("grad", [True, False])
def test_meta_forward(grad):
    """``model.to('meta')`` after a forward (the cache holds CPU norms): a forward on meta inputs gives meta outputs
    of PEFT's shape."""
    model, twin = _mlp_pair()
    x = torch.randn(4, 12)
    model(x)
    with torch.set_grad_enabled(grad):
        twin.to("meta")
        peft_out = twin(x.to("meta"))
        model.to("meta")
        out = model(x.to("meta"))
    assert out.is_meta and out.shape == peft_out.shape == (4, 8)


def test_pickle_a_model_with_dora_embeddings(monkeypatch):
    """``torch.save`` of an enabled model whose DoRA Embedding layers run PEFT's code (behind flashdora's counting
    variant), after training and eval forwards; the loaded model runs and matches PEFT."""
    model = _llama(0, small=False, targets=["q_proj", "v_proj", "embed_tokens"])
    twin = copy.deepcopy(model)
    flashdora.enable(model)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    for m in (model, twin):
        _forward(m, ids, "train", 0)
        _forward(m, ids, "no_grad", 0)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    pair = Pair(loaded, twin, 256, None, random.Random(0), monkeypatch)
    for mode in ("no_grad", "train", "inference_mode"):
        _check(pair, "loaded", mode, ids=ids)


def _second_order(fn, inputs, loss):
    """First-order gradients of ``loss(fn(*inputs))`` (with ``create_graph``) and the gradients of a weighted sum of
    those, as a gradient penalty or a Hessian-vector product takes them."""
    g = torch.Generator().manual_seed(0)
    y = fn(*inputs)
    w = torch.randn(y.shape, generator=g, dtype=y.dtype)
    out = (y * w).sum() if loss == "weighted-sum" else (y * w).square().sum()
    first = torch.autograd.grad(out, inputs, create_graph=True)
    hv = sum((d * torch.randn(d.shape, generator=g, dtype=d.dtype)).sum() for d in first)
    second = torch.autograd.grad(hv, inputs, allow_unused=True, materialize_grads=True)
    return [d.detach() for d in first] + list(second)


@pytest.mark.parametrize("loss", ["weighted-sum", "squared"])  # the output's gradient a constant, or not
@pytest.mark.parametrize("where", ["dora_linear", "layer"])
def test_double_backward_raises_or_matches_peft(where, loss):
    """Double backward: a RuntimeError is an honest answer; numbers other than PEFT's never are (float64 inputs)."""
    if where == "dora_linear":
        args = {k: v.double() if torch.is_tensor(v) else v for k, v in dora_inputs(6, 5, 3, lead=(2, 3)).items()}
        inputs = [args[k].requires_grad_() for k in ("x", "lora_A", "lora_B", "magnitude")]
        weight, bias, s = args["weight"], args["bias"], args["scaling"]
        out_fn = lambda x, a, b, m: flashdora.dora_linear(x, weight, bias, a, b, m, s)  # noqa: E731
        ref_fn = lambda x, a, b, m: dora_linear_ref(x, weight, bias, a, b, m, s)  # noqa: E731
    else:
        model, twin = _mlp_pair(torch.float64)
        names = [f"{n}.default.weight" for n in ("lora_A", "lora_B", "lora_magnitude_vector")]
        layers = [m.base_model.model.up for m in (model, twin)]

        def through(layer):
            return lambda x, *ps: torch.func.functional_call(layer, dict(zip(names, ps)), (x,))

        out_fn, ref_fn = through(layers[0]), through(layers[1])
        x = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
        inputs = [x] + [layers[0].get_parameter(n).detach().clone().requires_grad_() for n in names]
    ref = _second_order(ref_fn, inputs, loss)
    try:
        out = _second_order(out_fn, inputs, loss)
    except RuntimeError:
        return
    labels = [f"{order} d/d{name}" for order in ("first", "second") for name in ("x", "lora_A", "lora_B", "magnitude")]
    for label, o, r in zip(labels, out, ref):
        assert rel_err(o, r) <= 1e-9, f"{where}: {label} relative error {rel_err(o, r):.1e}"


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_swap_tensors_after_a_forward(backend, monkeypatch):
    """``torch.utils.swap_tensors`` refuses tensors with weak references: the cache (also what the Triton path keeps
    across optimizer steps) must hold none to a layer's base weight, lora_B or magnitude."""
    pair = _pair("gpt2", 0, monkeypatch, backend)
    _take(pair, "adamw-loop")
    _check(pair, "first forward", "train")
    _check(pair, "first forward", "no_grad")
    for kind in ("base", "lora_B", "magnitude"):
        owners = _owners(pair, kind)
        old = getattr(*owners[0])
        new = old.detach() * 1.3
        for module, attr in owners:
            torch.utils.swap_tensors(getattr(module, attr), nn.Parameter(new.clone(), requires_grad=old.requires_grad))
    _check(pair, "after swapping", "train")
    _check(pair, "after swapping", "no_grad")
