"""PEFT models and steps shared by the PEFT-seam tests (``test_peft_integration.py``, ``test_peft_autocast.py``)."""

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

import flashdora
from flashdora.tools.demo import build_peft_model
from tests.helpers import rel_err


@pytest.fixture(autouse=True)
def unpatched():
    flashdora.unpatch_peft()
    yield
    flashdora.unpatch_peft()


def llama(dropout=0.1, rank=8):
    return build_peft_model("tiny", rank, dropout, "cpu", seed=0)


def gpt2(dropout=0.1):
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


MODELS = [pytest.param(llama, 256, id="llama"), pytest.param(gpt2, 97, id="gpt2-conv1d")]


def make_ids(vocab, seed=1):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def train_step(model, ids, seed=123):
    """Training forward+backward with a fixed dropout seed; returns loss, logits and every trainable grad."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), out.logits.detach(), grads


@torch.no_grad()
def eval_logits(model, ids):
    model.eval()
    return model(input_ids=ids).logits


def assert_grads_close(out_grads, peft_grads, rtol=1e-4):
    assert out_grads.keys() == peft_grads.keys()
    assert any("magnitude" in k for k in out_grads)
    for name, peft_grad in peft_grads.items():
        assert rel_err(out_grads[name], peft_grad) <= rtol, name
