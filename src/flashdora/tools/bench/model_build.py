"""The model ``flashdora bench model`` builds: a transformers config (a preset or a file), random bf16 weights,
bitsandbytes projections under ``--quant``, and the PEFT adapters each mode wraps it in (docs/benchmarks.md)."""

from __future__ import annotations

import json

import torch
import transformers
from peft import LoraConfig, get_peft_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_LLAMA, _QWEN2 = "LlamaConfig", "Qwen2Config"
# name -> (transformers config class, fields); random weights, so only the shapes matter.
PRESETS = {
    "tiny": (
        _LLAMA,
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        ),
    ),
    "llama3-8b": (
        _LLAMA,
        dict(
            hidden_size=4096,
            num_hidden_layers=32,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
        ),
    ),
    "llama3-70b": (
        _LLAMA,
        dict(
            hidden_size=8192,
            num_hidden_layers=80,
            intermediate_size=28672,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
        ),
    ),
    "qwen2-7b": (
        _QWEN2,
        dict(
            hidden_size=3584,
            num_hidden_layers=28,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
        ),
    ),
    "qwen2.5-32b": (
        _QWEN2,
        dict(
            hidden_size=5120,
            num_hidden_layers=64,
            intermediate_size=27648,
            num_attention_heads=40,
            num_key_value_heads=8,
            vocab_size=152064,
        ),
    ),
}


def build_config(args) -> tuple[str, transformers.PretrainedConfig]:
    """(preset name, config): ``--config`` file or a preset, with ``--layers`` applied."""
    if args.config is not None:
        name = args.config.stem
        config = transformers.AutoConfig.for_model(**json.loads(args.config.read_text()))
    else:
        name = args.preset
        cls_name, fields = PRESETS[name]
        config = getattr(transformers, cls_name)(**fields)
    if args.layers is not None:
        config.num_hidden_layers = args.layers
        name = f"{name}-{args.layers}l"
    config.use_cache = False
    return name, config


def default_rank(config) -> int:
    """A rank that fits the shapes: a quarter of the hidden size, at most 384 (the 8B headline's rank)."""
    return max(1, min(384, config.hidden_size // 4))


def build_base(config, args, device) -> torch.nn.Module:
    """The frozen bf16 model on ``device`` (``--quant``: its projections quantized), ready to wrap (``prepare``)."""
    return prepare(build_weights(config, args, device), args)


def build_weights(config, args, device) -> torch.nn.Module:
    """The bf16 model from ``config`` on ``device``, seeded, its projections quantized under ``--quant``."""
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if getattr(args, "quant", "none") != "none":
        quantize(model, args.quant, device)
    return model


def prepare(model, args) -> torch.nn.Module:
    """``model`` frozen, gradient checkpointing on (unless ``--no-checkpointing``), input embeddings requiring grad.

    The embedding hook lets ``base`` run a backward (activation gradients only), the floor under LoRA.
    """
    model.requires_grad_(False)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model


def quantize(model, kind: str, device) -> None:
    """Every targeted projection replaced by a bitsandbytes layer holding its weights (``nf4``: ``Linear4bit``,
    bf16 compute; ``int8``: ``Linear8bitLt``), quantized as bitsandbytes does when a layer moves to the GPU."""
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name not in TARGETS or type(child) is not torch.nn.Linear:
                continue
            weight = child.weight.data.cpu()  # (bitsandbytes quantizes on the move from the CPU)
            if kind == "nf4":
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")  # fmt: skip
                layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            else:
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                            has_fp16_weights=False, device="meta")  # fmt: skip
                layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.data.cpu(), requires_grad=False)
            setattr(parent, name, layer.to(device))
            del child, weight


def wrap(model, args, use_dora: bool):
    """``model`` with PEFT adapters on every linear projection (fp32 under ``--dtype autocast``)."""
    torch.manual_seed(args.seed + 1)  # the same A and B values for LoRA and DoRA
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.rank,
        lora_dropout=args.dropout,
        target_modules=TARGETS,
        use_dora=use_dora,
        init_lora_weights=False,
    )
    with torch.device(model.device):  # adapters initialised where they live, not on the CPU first
        return get_peft_model(model, config, autocast_adapter_dtype=args.dtype == "autocast")
