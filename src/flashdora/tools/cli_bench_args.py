"""The options of ``flashdora bench layer|model|fsdp|serve``: one ``add_*_arguments`` per command (the other commands'
and the choices they share are in ``flashdora.tools.cli_args``). Imports nothing heavy: ``--help`` costs no torch
import.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flashdora.tools.cli_args import (  # (the choices and the helpers every command's options share)
    FSDP_MODES,
    LAYER_DTYPES,
    LAYER_MODES,
    LAYER_PHASES,
    LAYER_RANKS,
    LAYER_SHAPES,
    LAYER_TOKENS,
    MODEL_MODES,
    MODEL_PHASES,
    MODEL_PRESETS,
    SERVE_MODES,
    _common,
    parse_shape,
)
from flashdora.tools.cli_list import ListAction


def parse_range(text: str) -> tuple[int, int]:
    """``"1536-2048"`` -> ``(1536, 2048)``: an inclusive range of positive integers."""
    try:
        lo, hi = (int(v) for v in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI such as 1536-2048, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def add_layer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=None,
        metavar="DINxDOUT",
        help=f"layer shapes d_in x d_out (default on CUDA: {' '.join(LAYER_SHAPES)}; on the CPU: 256x512 512x256)",
    )
    p.add_argument("--ranks", nargs="+", type=int, help=f"LoRA ranks (default: {LAYER_RANKS}; on the CPU: 8)")
    p.add_argument("--tokens", nargs="+", type=int, help=f"tokens per call (default: {LAYER_TOKENS}; on the CPU: 64)")
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=LAYER_DTYPES,
        default=list(LAYER_DTYPES),
        help="autocast: bf16 weight, fp32 adapters, bf16 autocast; bf16: everything bf16 (default: both)",
    )
    p.add_argument(
        "--modes", nargs="+", choices=LAYER_MODES, default=list(LAYER_MODES), help="modes to time (default: all)"
    )
    p.add_argument(
        "--phases",
        nargs="+",
        choices=LAYER_PHASES,
        default=list(LAYER_PHASES),
        help="forward: no grad, fixed weights; fwd_bwd: forward and backward, weights marked changed (default: both)",
    )
    p.add_argument("--reps", type=int, default=20, help="timed calls per row; the median is reported (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (default: %(default)s)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every (tokens, phase) this many times over its modes, every second round in reverse order, and "
        "pool the rounds' calls (the median of all of them; round_ms: each round's median)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="time the modes call by call (every timed step runs each mode once, the order rotated step by step), so "
        "a change of the host's load hits every mode alike, but no mode runs right after itself as a model's layers "
        "do (a colder host); --reps calls per mode; peak memory from a separate run of each mode "
        "(at most 5 calls); not with --rounds",
    )
    p.add_argument(
        "--norm-shape",
        type=parse_shape,
        metavar="DINxDOUT",
        help="shape of the PEFT-norm vs factored-norm comparison (default: 8192x28672; on the CPU: 512x1024)",
    )
    p.add_argument("--norm-rank", type=int, help="rank of that comparison (default: 384; on the CPU: 16)")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel, device-peak and norm sections")
    p.add_argument(
        "--kernels-only",
        action="store_true",
        help="only the kernel sections: device peaks, the kernels alone and against their limits, the norm comparison "
        "(no PEFT layers timed)",
    )
    _common(p, results=True)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=MODEL_PRESETS, help="model shapes (default: llama3-8b; on the CPU: tiny)")
    p.add_argument("--config", type=Path, help="a transformers config.json instead of a preset")
    p.add_argument("--layers", type=int, help="override the number of decoder layers")
    p.add_argument(
        "--rank",
        type=int,
        help="LoRA rank; lora_alpha = rank (default: the model's hidden size / 4, at most 384: 16 for tiny, 384 for "
        "the others)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=MODEL_MODES,
        default=[m for m in MODEL_MODES if m not in ("flashdora_python", "flashdora_split", "flashdora_adapter")],
        help="base: no adapters; flashdora_python: flashdora with its C++ compose off (FLASHDORA_NATIVE=0); "
        "flashdora_split: flashdora with its C++ layer call off (the base layer called as a module); "
        "flashdora_nocache: flashdora with its norm cache off; flashdora_adapter: enable(model, dropout='adapter'), "
        "which differs only with --dropout > 0 (default: all but flashdora_python, flashdora_split and "
        "flashdora_adapter)",
    )
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="lora_dropout of every adapter, 0 <= p < 1; it drops in the grad and train phases (default: %(default)s)",
    )
    p.add_argument(
        "--phases",
        nargs="+",
        choices=MODEL_PHASES,
        default=["inference", "grad"],
        help="inference: forward without grad; grad: forward + backward, no optimizer step; train: forward + "
        "backward + AdamW step + zero_grad; decode: generate --new-tokens tokens after a --prompt-token prompt, "
        "batch 1, KV cache, reported per generated token (default: inference grad)",
    )
    p.add_argument(
        "--dtype",
        choices=("autocast", "bf16"),
        default="autocast",
        help="autocast: bf16 model, fp32 adapters (PEFT's default), bf16 autocast; bf16: all bf16",
    )
    p.add_argument("--batch", type=int, default=1, help="sequences per step, not decode's (default: %(default)s)")
    p.add_argument("--seq", type=int, help="tokens per sequence, not decode's (default: 2048; on the CPU: 128)")
    p.add_argument("--prompt", type=int, default=32, help="decode: prompt tokens, batch 1 (default: %(default)s)")
    p.add_argument(
        "--new-tokens", type=int, default=64, help="decode: tokens generated per timed step (default: %(default)s)"
    )
    p.add_argument("--reps", type=int, default=5, help="timed steps per row and round; the median is reported")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the whole sequence of modes this many times, every second round in reverse order, and pool "
        "each row's timed steps, so that a host that speeds up or slows down during the run, or a position in the "
        "order, weighs on every mode alike (eager only)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="hold a copy of the model per mode and time the modes step by step (every timed step runs each mode "
        "once, the start rotated), so that the host's drifts hit every mode alike; the Markdown adds each mode's "
        "paired ratio to PEFT LoRA. Every mode's model (and in train its optimizer state) is resident at once; "
        "not with --rounds",
    )
    p.add_argument(
        "--dynamic",
        type=parse_range,
        metavar="LO-HI",
        help="dynamic padding, with --interleave (grad and train): every timed step draws the tokens per sequence "
        "from LO..HI, the same for every mode of the step, and runs an untimed forward and backward of the model "
        "with its adapters off at that count first, so that what a new count costs the base model is paid outside "
        "the timed calls and what it costs each mode's adapters inside them",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing (default: %(default)s)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per timed grad or train step")
    p.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    p.add_argument(
        "--quant",
        choices=("none", "nf4", "int8"),
        default="none",
        help="quantize the base's projections with bitsandbytes (nf4: Linear4bit, bf16 compute; int8: "
        "Linear8bitLt): peft_lora is then QLoRA, peft_dora PEFT's QDoRA (default: %(default)s)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each mode's model (not with decode)")
    p.add_argument(
        "--host",
        action="store_true",
        help="one more untimed step per mode and phase with timers: host time of a LoRA layer call by phase "
        "(forward, checkpointing's recomputation, the backward of the compose node, norm cache misses) and of the "
        "optimizer step; the GPU's kernel time and the host gap are reported on CUDA without it",
    )
    _common(p, results=True)


def add_fsdp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, help="ranks (default: every CUDA device, else 2 CPU processes)")
    p.add_argument("--preset", choices=MODEL_PRESETS, help="model shapes (default: llama3-8b; on the CPU: tiny)")
    p.add_argument("--layers", type=int, help="override the number of decoder layers")
    p.add_argument("--ranks", type=int, nargs="+", help="LoRA ranks (default: 384 16; on the CPU: 16)")
    p.add_argument("--modes", nargs="+", choices=FSDP_MODES, default=list(FSDP_MODES), help="default: all")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: 2048; on the CPU: 128)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank and step (default: %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="timed steps; the median is reported (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (default: %(default)s)")
    p.add_argument(
        "--mp",
        choices=("bf16", "off", "both"),
        default="bf16",
        help="bf16: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32); off: the parameters' own dtypes "
        "(float32 throughout; with --meta, float32 adapters on the bfloat16 base under bf16 autocast); both: "
        "every row twice (default: %(default)s)",
    )
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default: %(default)s)")
    p.add_argument(
        "--lora-init",
        choices=("random", "peft"),
        default="random",
        help="random: a random non-zero lora_B (the adapter term is already large); peft: PEFT's default, lora_B "
        "zero (the adapter term starts at zero, as a user's fine-tuning does) (default: %(default)s)",
    )
    p.add_argument(
        "--row-timeout",
        type=float,
        default=1800.0,
        help="seconds one row's launch may run before it is killed and recorded as an error; the rows done so far "
        "are written after each row (default: %(default)s)",
    )
    p.add_argument(
        "--meta",
        action="store_true",
        help="build on the meta device, shard, then fill each rank's shards with random values: a bfloat16 base "
        "and float32 adapters, for models that do not fit one GPU in float32 (llama3-70b)",
    )
    p.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="one launch per rank and policy holding a model per mode, each timed step running every mode once (the "
        "order rotated): the modes share the host's slow drifts, which a launch per mode does not; peak memory is "
        "then each step's peak above what it started with (all models resident)",
    )
    _common(p, results=True)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=MODEL_PRESETS, help="model shapes (default: llama3-8b; on the CPU: tiny)")
    p.add_argument("--config", type=Path, help="a transformers config.json instead of a preset")
    p.add_argument("--layers", type=int, help="override the number of decoder layers")
    lists = dict(nargs="+", action=ListAction, integers=True, metavar="N")
    p.add_argument("--adapters", default=[1, 4, 16], help="adapters K served in one batch (default: 1,4,16)", **lists)
    p.add_argument("--ranks", default=[16, 64], help="LoRA ranks; lora_alpha = 2 rank (default: 16,64)", **lists)
    p.add_argument(
        "--requests", type=int, default=16, help="requests per batch; request i uses adapter i %% K (default: 16)"
    )
    p.add_argument("--prompt", type=int, help="decode: prompt tokens per request (default: 128; on the CPU: 32)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode: greedy steps timed (default: %(default)s)")
    p.add_argument("--prefill-prompt", type=int, help="prefill: tokens per request (default: 512; on the CPU: 64)")
    p.add_argument("--reps", type=int, default=3, help="timed steps per mode; the median is reported (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default: %(default)s)")
    p.add_argument(
        "--modes",
        nargs="+",
        action=ListAction,
        allowed=SERVE_MODES,
        metavar="MODE",
        default=list(SERVE_MODES),
        help="peft_lora_one: PEFT LoRA, one adapter for the batch (the floor); peft_lora_mixed: PEFT LoRA, "
        "adapter_names; peft_dora_loop: PEFT DoRA, a sub-batch per adapter; flashdora_mixed: flashdora, "
        "adapter_names over DoRA adapters (default: all)",
    )
    _common(p, results=True)
