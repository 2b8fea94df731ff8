"""Tiny Llama models with bitsandbytes bases for the QDoRA tests."""

import warnings

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from flashdora.tools.bench.model_build import TARGETS


def quantize(module: nn.Module, kind: str, compute_dtype: torch.dtype, device: str) -> None:
    """Every Linear but the LM head replaced by a bitsandbytes layer holding the same weights."""
    import bitsandbytes as bnb

    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and name != "lm_head":
            if kind == "int8":
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                            has_fp16_weights=False)  # fmt: skip
                layer.weight = bnb.nn.Int8Params(child.weight.data.cpu(), requires_grad=False, has_fp16_weights=False)
            else:
                layer = bnb.nn.Linear4bit(
                    child.in_features, child.out_features, bias=child.bias is not None, compute_dtype=compute_dtype,
                    quant_type=kind.removesuffix("-dq"), compress_statistics=kind.endswith("-dq"),
                )  # fmt: skip
                layer.weight = bnb.nn.Params4bit(
                    child.weight.data.cpu().clone(), requires_grad=False, quant_type=kind.removesuffix("-dq"),
                    compress_statistics=kind.endswith("-dq"),
                )  # fmt: skip
                # (on AVX512-BF16 hosts bitsandbytes rewrites the layout in place at the first eval forward, after
                # which PEFT's dequantization reads garbage)
                layer.support_avx512bf16_for_cpu = False
            setattr(module, name, layer.to(device))  # (int8 quantizes when moved to CUDA)
        else:
            quantize(child, kind, compute_dtype, device)


# ``small=True``: one block at half width, for the tests the Triton interpreter runs (its time grows with the weights'
# size). Every weight still holds whole 64-value 4-bit blocks of bitsandbytes (the smallest, k_proj: 16 x 32).
FULL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)


def qdora_model(kind="nf4", compute_dtype=torch.float32, dropout=0.0, seed=0, device="cpu", peft_bnb=False,
                small=False):  # fmt: skip
    """``peft_bnb``: the model says it is loaded quantized, so PEFT wraps its quantized layers in its ``lora.bnb``
    classes (as with a model loaded by ``from_pretrained``; by default PEFT's generic ``Linear`` wraps them).
    ``small``: ``SMALL``."""
    torch.manual_seed(seed)
    config = LlamaConfig(**(SMALL if small else FULL), num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         use_cache=False)  # fmt: skip
    base = LlamaForCausalLM(config).to(device)
    quantize(base, kind, compute_dtype, device)
    base.is_loaded_in_4bit = peft_bnb and kind != "int8"
    base.is_loaded_in_8bit = peft_bnb and kind == "int8"
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, use_dora=True, target_modules=TARGETS,
                      init_lora_weights=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(base, lora)


def bf16_model(device="cpu", peft_bnb=False, small=False):
    """``qdora_model("nf4")`` with bf16 compute whose weights dequantize to bf16, the layer's compute dtype."""
    import bitsandbytes as bnb

    model = qdora_model("nf4", compute_dtype=torch.bfloat16, device=device, peft_bnb=peft_bnb, small=small)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.weight.quant_state.dtype = torch.bfloat16
    return model


def count_dequantizations(monkeypatch):
    """A list that records each dequantization of a base by the norm cache."""
    from flashdora.ops import norm_cache

    calls = []
    real = norm_cache.dequantized
    monkeypatch.setattr(norm_cache, "dequantized", lambda base, *packed: calls.append(base) or real(base, *packed))
    return calls


def int8_bf16_model(device="cpu", peft_bnb=False, small=False):
    """``qdora_model("int8")`` in bf16 around its int8 layers (embeddings, norms, the head)."""
    model = qdora_model("int8", device=device, peft_bnb=peft_bnb, small=small)
    for p in model.parameters():
        if not p.requires_grad and p.dtype == torch.float32:
            p.data = p.data.to(torch.bfloat16)
    return model
