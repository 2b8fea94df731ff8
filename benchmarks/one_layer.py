"""The one-layer PEFT model the host-cost scripts time (``host_layer.py``, ``host_backward.py``): a bf16
``nn.Linear`` with its bias, wrapped by PEFT LoRA or DoRA (non-zero ``lora_B``, scaling 1). Also the inputs of
``bench layer``'s own step for the scripts that take it apart (``fwd_bwd_split.py``, ``backward_nodes.py``,
``peak_live.py``)."""

import torch
from peft import LoraConfig, get_peft_model


def add_layer_arguments(p) -> None:
    """The options both scripts take: the layer's shape and rank, tokens per call, turns and calls per turn."""
    p.add_argument("--shape", default="4096x4096", help="d_in x d_out")
    p.add_argument("--rank", type=int, default=384)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--calls", type=int, default=300)


def peft_layer(d_in: int, d_out: int, rank: int, use_dora: bool, device):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, dtype=torch.bfloat16, device=device))
    cfg = LoraConfig(r=rank, lora_alpha=rank, use_dora=use_dora, target_modules=["0"], init_lora_weights=False)
    return get_peft_model(net, cfg)


def add_step_arguments(p) -> None:
    """The options of the scripts that run ``bench layer``'s step: the layer's shape and rank, tokens per call."""
    p.add_argument("--shape", default="4096x4096", help="d_in x d_out")
    p.add_argument("--rank", type=int, default=384)
    p.add_argument("--tokens", type=int, default=2048)


def step_inputs(args, device="cuda"):
    """``(weight, x, dy)`` for ``bench.layer.build_layer(s)`` and ``step_fn``: a bf16 ``[d_out, d_in]`` weight, the
    input (it requires grad) and the output gradient, from seed 0."""
    d_in, d_out = (int(v) for v in args.shape.split("x"))
    torch.manual_seed(0)
    weight = torch.randn(d_out, d_in, device=device, dtype=torch.bfloat16) / d_in**0.5
    x = torch.randn(args.tokens, d_in, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(args.tokens, d_out, device=device, dtype=torch.bfloat16)
    return weight, x, dy
