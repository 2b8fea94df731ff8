"""``enable`` on a model with nothing to switch warns once, naming what it found; a DoRA model does not warn."""

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import flashdora
from tests.peft_models import llama


def _tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return LlamaForCausalLM(config)


def _enable_warnings(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returned = flashdora.enable(model)
    assert returned is model
    return [
        str(w.message) for w in caught if issubclass(w.category, UserWarning) and "flashdora.enable" in str(w.message)
    ]


def test_lora_without_dora_warns_with_the_counts():
    model = get_peft_model(_tiny_llama(), LoraConfig(r=4, target_modules="all-linear"))
    messages = _enable_warnings(model)
    # 2 layers x 7 projections, none with use_dora=True
    assert messages == [
        "flashdora.enable: nothing to enable in PeftModel: 14 LoRA layers, 0 with use_dora=True; "
        "build the adapters with LoraConfig(use_dora=True)"
    ]


@pytest.mark.parametrize(
    "make, name",
    [pytest.param(_tiny_llama, "LlamaForCausalLM", id="transformers"), (lambda: torch.nn.Linear(4, 4), "Linear")],
)
def test_a_model_without_lora_layers_warns(make, name):
    messages = _enable_warnings(make())
    assert len(messages) == 1
    assert messages[0].startswith(f"flashdora.enable: nothing to enable in {name}: no PEFT LoRA layers; ")


def test_a_dora_model_does_not_warn():
    model = llama()
    assert _enable_warnings(model) == []
    flashdora.disable(model)
