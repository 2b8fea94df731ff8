"""The norm cache: one norm per weight version, never a stale one."""

import copy
import random

import pytest
import torch
from peft import LoraConfig

import flashdora
from flashdora.tools.demo import build_peft_model

N_LAYERS = 14  # tiny Llama: 2 layers x 7 projections


def _model(dropout=0.0):
    model = build_peft_model("tiny", 4, dropout, "cpu")
    model.base_model.model.config.use_cache = False
    return flashdora.enable(model)


def _ids(seed):
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))


def _norm_computations():
    counts = flashdora.stats()
    return counts.get("norm:eager", 0) + counts.get("norm:triton", 0)


def _logits_without_cache(model, ids, monkeypatch):
    monkeypatch.setenv("FLASHDORA_NORM_CACHE", "0")
    with torch.no_grad():
        out = model(input_ids=ids).logits
    monkeypatch.delenv("FLASHDORA_NORM_CACHE")
    return out


def test_eval_computes_each_norm_once():
    model = _model().eval()
    flashdora.reset_stats()
    with torch.no_grad():
        for seed in range(5):
            model(input_ids=_ids(seed))
    assert _norm_computations() == N_LAYERS
    assert flashdora.stats()["norm:cached"] == 4 * N_LAYERS


OPTIMIZERS = {  # fused kernels write parameters without moving their version counters
    "loop": dict(foreach=False),
    "foreach": dict(foreach=True),
    "fused": dict(fused=True),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_one_norm_per_optimizer_step_with_accumulation_and_checkpointing(kind):
    model = _model(dropout=0.1)
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, **OPTIMIZERS[kind])
    for step in range(3):
        flashdora.reset_stats()
        for micro in range(4):
            model(input_ids=_ids(10 * step + micro), labels=_ids(10 * step + micro)).loss.backward()
        assert _norm_computations() == N_LAYERS, (step, flashdora.stats())
        assert flashdora.stats()["eager"] == 8 * N_LAYERS  # 4 forwards + 4 checkpoint recomputations
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("how", ["env", "argument"])
def test_cache_can_be_turned_off(how, monkeypatch):
    if how == "env":
        monkeypatch.setenv("FLASHDORA_NORM_CACHE", "0")
        model = _model().eval()
    else:
        model = flashdora.enable(_model(), norm_cache=False).eval()
    flashdora.reset_stats()
    with torch.no_grad():
        for seed in range(3):
            model(input_ids=_ids(seed))
    assert _norm_computations() == 3 * N_LAYERS and "norm:cached" not in flashdora.stats()


def test_enable_rejects_a_non_bool_norm_cache():
    with pytest.raises(TypeError, match="enable: norm_cache expected a bool, got str"):
        flashdora.enable(torch.nn.Linear(2, 2), norm_cache="no")


def _lora_params(model):
    return [p for n, p in model.named_parameters() if "lora_" in n]


def _action(rng, model, opt, state):
    """Apply one random action that may change weights, adapters or modes; returns its name."""
    ids = _ids(rng.randrange(1000)).to(model.device)
    name = rng.choice(
        [
            "train_step",
            "forward_backward",
            "eval",
            "inplace_lora",
            "inplace_base",
            "switch_adapter",
            "merge_unmerge",
            "load_state_dict",
            "to_double_and_back",
            "optimizer_step",
        ]
    )
    if name in ("train_step", "forward_backward"):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        if name == "train_step":
            opt.step()
            opt.zero_grad()
    elif name == "optimizer_step":
        opt.step()
        opt.zero_grad()
    elif name == "eval":
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)
    elif name == "inplace_lora":
        with torch.no_grad():
            rng.choice(_lora_params(model)).mul_(1.1)
    elif name == "inplace_base":
        with torch.no_grad():
            model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.add_(0.01)
    elif name == "switch_adapter":
        state["adapter"] = "other" if state["adapter"] == "default" else "default"
        model.set_adapter(state["adapter"])
    elif name == "merge_unmerge":
        model.merge_adapter()
        model.unmerge_adapter()
    elif name == "load_state_dict":
        sd = {k: v * 1.05 if "lora_B" in k else v for k, v in model.state_dict().items()}
        model.load_state_dict(sd)
    elif name == "to_double_and_back":
        model.double()
        with torch.no_grad():
            model.eval()(input_ids=ids)
        model.float()
    return name


class _CudaMemory:
    """A CUDA tensor's memory as an object ``torch.as_tensor`` wraps in a new storage, without a copy (where the
    allocator's reuse of a freed block is not deterministic enough to wait for)."""

    def __init__(self, t):
        self.t = t
        self.__cuda_array_interface__ = t.__cuda_array_interface__


def _swap_in_at_the_same_address(p, values):
    """``p.data = new`` where ``new`` is a new storage at ``p``'s old address holding ``values``: what the allocator
    gives a parameter whose storage is freed and reallocated, as PEFT's DoRA unmerge (``W / f - delta``) can."""
    ptr, version = p.data_ptr(), p._version
    if p.is_cuda:  # the old memory, under a storage made from its CUDA array interface (which keeps the old alive)
        new = torch.as_tensor(_CudaMemory(p.detach()), device=p.device)
        new.copy_(values)
    else:
        raw = p.detach().numpy()  # the old memory, under a storage numpy owns
        raw[...] = values.numpy()
        new = torch.from_numpy(raw)
    p.data = new
    assert (p.data_ptr(), p._version) == (ptr, version)  # what the cache key held before storage numbers


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("which", ["base", "lora_B", "magnitude"])
def test_a_new_storage_at_the_old_address_is_seen(which, device, monkeypatch):
    model = build_peft_model("tiny", 4, 0.0, device, seed=2)
    model.base_model.model.config.use_cache = False
    flashdora.enable(model).eval()
    layer = model.base_model.model.model.layers[0].self_attn.k_proj
    p = {
        "base": layer.base_layer.weight,
        "lora_B": layer.lora_B["default"].weight,
        "magnitude": layer.lora_magnitude_vector["default"].weight,
    }[which]
    ids = _ids(0).to(device)
    with torch.no_grad():
        before = model(input_ids=ids).logits  # fills the cache
        _swap_in_at_the_same_address(p, p.detach() * 1.05)
        cached = model(input_ids=ids).logits
    fresh = _logits_without_cache(model, ids, monkeypatch)
    assert (fresh - before).abs().max() > 1e-4  # the swap changed the output, so a stale norm would show
    torch.testing.assert_close(cached, fresh, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("seed", range(2))
def test_cached_path_always_equals_a_fresh_computation(seed, kind, device, monkeypatch):
    """On CUDA the recomputations replay each layer's captured norm graph (checked at the end)."""
    rng = random.Random(seed)
    model = build_peft_model("tiny", 4, 0.1, device, seed=seed)
    model.add_adapter(
        "other", LoraConfig(r=2, use_dora=True, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    )
    model.base_model.model.config.use_cache = False
    flashdora.enable(model)
    opt = torch.optim.AdamW(_lora_params(model), lr=0.05, **OPTIMIZERS[kind])  # big steps: a stale norm would show
    state = {"adapter": "default"}
    peft_twin = None
    for _ in range(25):
        name = _action(rng, model, opt, state)
        ids = _ids(rng.randrange(1000)).to(device)
        model.eval()
        with torch.no_grad():
            cached = model(input_ids=ids).logits
        fresh = _logits_without_cache(model, ids, monkeypatch)
        torch.testing.assert_close(cached, fresh, rtol=1e-6, atol=1e-6, msg=f"after {name}")
        # and against PEFT itself on the current weights
        peft_twin = flashdora.disable(copy.deepcopy(model))
        with torch.no_grad():
            torch.testing.assert_close(
                cached, peft_twin(input_ids=ids).logits, rtol=1e-5, atol=1e-5, msg=f"vs PEFT after {name}"
            )


@pytest.mark.gpu
def test_each_recomputation_on_cuda_equals_a_fresh_norm():
    """CUDA (Triton path): after every fused optimizer step each layer's cached norm and scales equal a fresh
    computation of the new weights."""
    from flashdora.ops.norm import compute_norm
    from flashdora.ops.norm_cache import NormCache

    model = build_peft_model("tiny", 4, 0.0, "cuda", seed=3)
    model.base_model.model.config.use_cache = False
    flashdora.enable(model)
    opt = torch.optim.AdamW(_lora_params(model), lr=0.05, fused=True)
    layers = [m for m in model.modules() if hasattr(m, "lora_magnitude_vector") and "default" in m.lora_B]
    for step in range(4):
        ids = _ids(step).cuda()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        flashdora.reset_stats()
        model(input_ids=ids)  # the norm of the new weights
        assert flashdora.stats()["norm:triton"] == len(layers)
        for layer in layers:
            owner = layer.lora_magnitude_vector["default"]
            cache = owner.__dict__["_flashdora_cache"]
            w = layer.get_base_layer().weight
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            fresh = compute_norm(w.detach(), a.detach(), b.detach(), float(layer.scaling["default"]))
            torch.testing.assert_close(cache["norm"], fresh, rtol=1e-6, atol=0)
            m = owner.weight.detach()
            torch.testing.assert_close(cache["scales"][0], m / fresh, rtol=1e-6, atol=0)
    assert NormCache._owners


def test_a_miss_records_nothing_and_leaves_grad_mode_as_it_was(monkeypatch):
    """A miss computes under grad off (the inputs are parameters) and restores the caller's grad mode, also when the
    computation raises."""
    from flashdora.ops import norm_cache

    class Owner:
        pass

    owner = Owner()
    w = torch.randn(12, 10)
    a, b = torch.randn(3, 10, requires_grad=True), torch.randn(12, 3, requires_grad=True)
    m = (w.norm(dim=1) * 1.1).requires_grad_()
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            torch.autograd.graph.increment_version([a])
            got = norm_cache.NormCache.lookup_owner(w, a, b, m, 0.5, owner)
            assert torch.is_grad_enabled() is grad
    assert got.grad_fn is None and not got.requires_grad

    def boom(*args, **kwargs):
        assert not torch.is_grad_enabled()
        raise RuntimeError("boom")

    monkeypatch.setattr(norm_cache, "fresh", boom)
    torch.autograd.graph.increment_version([a])
    with pytest.raises(RuntimeError, match="boom"):
        norm_cache.NormCache.lookup_owner(w, a, b, m, 0.5, owner)
    assert torch.is_grad_enabled()


def test_copies_of_a_model_get_their_own_cache():
    """deepcopy (EMA or reference models) and pickling start a layer's cache afresh, never share the original's."""
    import pickle

    model = _model().eval()
    ids = _ids(0)
    with torch.no_grad():
        model(input_ids=ids)
    twin = copy.deepcopy(model)
    pickle.loads(pickle.dumps(model))
    flashdora.reset_stats()
    with torch.no_grad():
        twin(input_ids=ids)
        model(input_ids=ids)
        twin(input_ids=ids)
    assert _norm_computations() == N_LAYERS  # the twin computes its own once; the original keeps its cache
    for owner in (m.lora_magnitude_vector["default"] for m in twin.modules() if hasattr(m, "lora_magnitude_vector")):
        assert owner._flashdora_cache_id == id(owner)


def _two_adapter_model(device, seed):
    """The tiny Llama at half its width (hidden 32, MLP 64), two adapters: the Triton interpreter's time goes with the
    weights' size, and what is checked on it does not."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    from flashdora.tools.bench.model_build import TARGETS
    from tests.cache_helpers import tiny_llama_config

    torch.manual_seed(seed)
    lora = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(LlamaForCausalLM(tiny_llama_config(half=True)).to(device), lora)
    model.add_adapter(
        "other", LoraConfig(r=2, use_dora=True, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    )
    return flashdora.enable(model)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_norm_per_training_layer_per_step_across_an_adapter_switch(device, monkeypatch):
    """Triton path (on the CPU through the interpreter): after each optimizer step every training layer recomputes
    its norm once, and its cache holds what a fresh computation gives, also after switching adapters."""
    from flashdora.ops.norm import compute_norm

    if device == "cpu":
        monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    model = _two_adapter_model(device, seed=5)
    adapter = "default"
    for step in range(4):
        if step == 2:
            adapter = "other"
            model.set_adapter(adapter)  # PEFT freezes the default adapter
        layers = [m for m in model.modules() if hasattr(m, "lora_magnitude_vector") and adapter in m.lora_B]
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=0.05)
        ids = _ids(step).to(device)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        flashdora.reset_stats()
        model.eval()
        with torch.no_grad():
            cached = model(input_ids=ids).logits
        assert _norm_computations() == len(layers), (step, flashdora.stats())
        fresh_logits = _logits_without_cache(model, ids, monkeypatch)
        torch.testing.assert_close(cached, fresh_logits, rtol=1e-6, atol=1e-6, msg=f"step {step}")
        for layer in layers:
            owner = layer.lora_magnitude_vector[adapter]
            cache = owner.__dict__["_flashdora_cache"]
            w = layer.get_base_layer().weight
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            fresh = compute_norm(w.detach(), a.detach(), b.detach(), float(layer.scaling[adapter]))
            torch.testing.assert_close(cache["norm"], fresh, rtol=1e-6, atol=0)
            torch.testing.assert_close(cache["scales"][0], owner.weight.detach() / fresh, rtol=1e-6, atol=0)
