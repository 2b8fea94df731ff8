"""The options of ``flashdora``'s commands: their choices and defaults as plain constants, and one ``add_*_arguments``
per command.

Split from ``flashdora.tools.cli`` (which assembles the parser, checks the options and runs the command, and
re-exports these names). Like it, this module imports nothing heavy: ``--help`` costs no torch import.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flashdora.tools.cli_list import ListAction

# Choices, as plain constants; tests/test_cli_help.py checks each against the module that owns it.
DEMO_SIZES = ("tiny", "small", "medium", "base", "wide")  # flashdora.tools.demo.SIZES
PARITY_DTYPES = ("fp32", "autocast")  # flashdora.tools.parity.MODES
LAYER_MODES = ("peft_lora", "peft_dora", "flashdora")  # flashdora.tools.bench.layer_render.MODES
LAYER_PHASES = ("forward", "fwd_bwd")  # flashdora.tools.bench.layer_render.PHASES
# flashdora.tools.bench.model_build.PRESETS
MODEL_PRESETS = ("tiny", "llama3-8b", "llama3-70b", "qwen2-7b", "qwen2.5-32b")
# flashdora.tools.bench.model_render.MODES
MODEL_MODES = (
    "base",
    "peft_lora",
    "peft_dora",
    "flashdora",
    "flashdora_python",
    "flashdora_nocache",
    "flashdora_adapter",
)
MODEL_PHASES = ("inference", "grad", "train", "decode")  # flashdora.tools.bench.model_render.PHASES
FSDP_MODES = ("peft_lora", "peft_dora", "flashdora")  # flashdora.tools.bench.fsdp.MODES
SERVE_MODES = ("peft_lora_one", "peft_lora_mixed", "peft_dora_loop", "flashdora_mixed")  # bench.serve_render.MODES
# ``bench layer``'s defaults
LAYER_SHAPES = ("4096x4096", "4096x14336", "14336x4096", "8192x28672", "5120x27648")
LAYER_RANKS = (16, 64, 384)
LAYER_TOKENS = (2048, 8192)
LAYER_DTYPES = ("autocast", "bf16")


def parse_shape(text: str) -> tuple[int, int]:
    """``"4096x14336"`` -> ``(4096, 14336)`` as (d_in, d_out)."""
    try:
        d_in, d_out = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape expected D_INxD_OUT such as 4096x14336, got {text!r}") from None
    if d_in < 1 or d_out < 1:
        raise argparse.ArgumentTypeError(f"shape expected positive sizes, got {text!r}")
    return d_in, d_out


def _common(p: argparse.ArgumentParser, results: bool) -> None:
    """``--device``, ``--seed`` and, for commands that write result files, ``--out`` and ``--tag``."""
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and inputs (default: %(default)s)")
    if results:
        p.add_argument(
            "--out", default=None, help="result folder (default: ./flashdora-bench; the docs cite benchmarks/results)"
        )
        p.add_argument("--tag", default=None, help="suffix for the result file names, e.g. accum4")


def parse_range(text: str) -> tuple[int, int]:
    """``"1536-2048"`` -> ``(1536, 2048)``: an inclusive range of positive integers."""
    try:
        lo, hi = (int(v) for v in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI such as 1536-2048, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--size", choices=DEMO_SIZES, default=None, help="model size (default: small on CPU, medium on CUDA)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=8,
        help="training steps per run, the first 3 on CUDA (1 on the CPU) untimed (default: %(default)s)",
    )
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (default: %(default)s)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 128 on CPU, 512 on CUDA)")
    p.add_argument("--rank", type=int, default=16, help="DoRA rank (default: %(default)s)")
    p.add_argument("--dropout", type=float, default=0.05, help="lora_dropout, 0 <= p < 1 (default: %(default)s)")
    _common(p, results=False)


def _add_pretrain_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    """flashdora.tools.parity_pretrain's options, for parity and dropout-study (it imports torch, so they are written
    here); ``steps``: --pretrain's default."""
    p.add_argument(
        "--pretrain",
        type=int,
        default=steps,
        metavar="STEPS",
        help="train the base model this many steps (all parameters) before attaching the adapters, then scale lora_B "
        "to --lora-b-ratio: a fine-tuning-like start (0: random weights; default: %(default)s)",
    )
    p.add_argument("--pretrain-lr", type=float, default=1e-3, help="peak lr of --pretrain (default 1e-3)")
    p.add_argument(
        "--lora-b-ratio",
        type=float,
        default=0.07,
        help="with --pretrain: median ||s B A|| / ||W|| per row after scaling lora_B (default 0.07)",
    )


def add_parity_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=DEMO_SIZES, default=None, help="model size (default: tiny on CPU, wide on CUDA)")
    p.add_argument("--steps", type=int, default=50, help="training steps per seed (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=1, help="seeds, each a fresh model and data order (default: 1)")
    p.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="seeds run are first-seed .. first-seed + seeds - 1 (default 0), so a long comparison can be split over "
        "several runs",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also train PEFT DoRA on a copy with every magnitude one float32 ulp off: the |delta loss| that "
        "chaotic training reaches between two runs of the same model (takes half as long again)",
    )
    _add_pretrain_arguments(p, 0)
    p.add_argument("--rank", type=int, default=16, help="DoRA rank (default: %(default)s)")
    p.add_argument("--dropout", type=float, default=0.05, help="lora_dropout, 0 <= p < 1 (default: %(default)s)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 64 on CPU, 512 on CUDA)")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default: %(default)s)")
    p.add_argument(
        "--dtype",
        choices=PARITY_DTYPES,
        default=None,
        help="training precision: fp32, or bf16 autocast over fp32 weights (default: autocast on CUDA, fp32 on CPU); "
        "the logit check always runs both",
    )
    _common(p, results=True)
    p.add_argument("--no-check", action="store_true", help="exit 0 even when a bar fails")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="combine parity results of the same settings on different seeds (e.g. one --first-seed per device call) "
        "into one result; trains nothing",
    )


def add_dropout_study_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=DEMO_SIZES, default="small", help="model size (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="fine-tuning AdamW steps per variant (default: %(default)s)")
    p.add_argument(
        "--seeds", type=int, default=3, help="seeds, each a fresh base, adapters and data order (default: 3)"
    )
    p.add_argument(
        "--first-seed", type=int, default=0, help="seeds run are first-seed .. first-seed + seeds - 1 (default 0)"
    )
    _add_pretrain_arguments(p, 300)
    p.add_argument("--rank", type=int, default=16, help="LoRA / DoRA rank (default: %(default)s)")
    p.add_argument("--dropout", type=float, default=0.1, help="lora_dropout, 0 <= p < 1 (default: %(default)s)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="fine-tuning AdamW learning rate (default: %(default)s)")
    p.add_argument(
        "--heldout-batches",
        type=int,
        default=16,
        help="batches of the held-out text (the corpus's last 10%%, never trained on) the final loss is averaged "
        "over (default: %(default)s)",
    )
    _common(p, results=True)


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
        default=[m for m in MODEL_MODES if m not in ("flashdora_python", "flashdora_adapter")],
        help="base: no adapters; flashdora_python: flashdora with its C++ compose off (FLASHDORA_NATIVE=0); "
        "flashdora_nocache: flashdora with its norm cache off; flashdora_adapter: enable(model, dropout='adapter'), "
        "which differs only with --dropout > 0 (default: all but flashdora_python and flashdora_adapter)",
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
        help="dynamic padding, with --interleave (grad and train): every timed step draws the tokens per sequence from "
        "LO..HI, the same for every mode of the step, and runs an untimed forward and backward of the model with its "
        "adapters off at that count first, so that what a new count costs the base model is paid outside the timed "
        "calls and what it costs each mode's adapters inside them",
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


_ADD = {
    "build": lambda p: None,  # (no options)
    "demo": add_demo_arguments,
    "parity": add_parity_arguments,
    "dropout-study": add_dropout_study_arguments,
    "bench layer": add_layer_arguments,
    "bench model": add_model_arguments,
    "bench fsdp": add_fsdp_arguments,
    "bench serve": add_serve_arguments,
}
