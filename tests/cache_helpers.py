"""The twin harness behind tests/test_cache_routes.py and tests/test_cache_crashes.py.

A ``Pair`` is a PEFT model with two DoRA adapters (a tiny Llama on ``nn.Linear`` or a GPT-2 on ``Conv1D``), enabled,
and its PEFT twin, a copy made before ``enable``. ``_check`` compares the enabled model's output (and, in training,
every gradient) with (a) itself with the cache off (``FLASHDORA_NORM_CACHE=0``) and (b) the twin. ``_owners`` and
friends find where a route writes: a DoRA layer's tensors, for the active adapter.
"""

import copy
import random
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import LoraLayer
from torch import nn
from torch.nn.utils import parametrize
from transformers import GPT2Config, GPT2LMHeadModel

import flashdora
from flashdora.tools.bench.model_build import TARGETS
from flashdora.tools.demo import SIZES
from tests.helpers import RTOL, rel_err

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


def tiny_llama_config(half: bool, blocks: int | None = None):
    """The demo's tiny Llama's config (``SIZES["tiny"]``, 64 positions); ``half``: at half width (hidden 32, MLP 64),
    where the Triton interpreter runs (its time grows with the weights' size); ``blocks``: other than the demo's."""
    from transformers import LlamaConfig

    hidden, n_blocks, inter, heads, kv, vocab = SIZES["tiny"]
    if half:
        hidden, inter = hidden // 2, inter // 2
    return LlamaConfig(
        hidden_size=hidden, num_hidden_layers=n_blocks if blocks is None else blocks, intermediate_size=inter,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=64,
        use_cache=False,
    )  # fmt: skip


def _llama(seed: int, small: bool, targets=None):
    """The demo's tiny Llama (``build_peft_model("tiny", ...)``) with DoRA at rank 4 on ``targets`` (default: every
    projection); ``small``: one block at half width (hidden 32, MLP 64), DoRA on three projections."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(small, 1 if small else None)
    if targets is None:
        targets = ["q_proj", "v_proj", "down_proj"] if small else TARGETS
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, use_dora=True, target_modules=targets, init_lora_weights=False
    )
    torch.manual_seed(seed)
    return get_peft_model(LlamaForCausalLM(config), lora)


def _gpt2(seed: int, small: bool):
    """``tests/peft_models.gpt2`` (``Conv1D`` layers, ``fan_in_fan_out``); ``small``: one block at half width."""
    torch.manual_seed(seed)
    config = GPT2Config(n_embd=16 if small else 32, n_layer=1 if small else 2, n_head=4, vocab_size=97, n_positions=64,
                        use_cache=False)  # fmt: skip
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, use_dora=True, fan_in_fan_out=True,
        target_modules=["c_attn", "c_proj", "c_fc"], init_lora_weights=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(GPT2LMHeadModel(config), lora)


def _pair(name: str, seed: int, monkeypatch, backend: str = "eager") -> Pair:
    """A Llama (``nn.Linear``) or GPT-2 (``Conv1D``) with two DoRA adapters, enabled, and its PEFT twin; smaller
    under Triton (interpreted on the CPU: its time grows with the weights' size)."""
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
