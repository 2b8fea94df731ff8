"""The options of ``flashdora``'s commands: their choices and defaults as plain constants, the helpers every command's
options share, and one ``add_*_arguments`` per command but ``bench`` (``flashdora.tools.cli_bench_args``).

Split from ``flashdora.tools.cli`` (which assembles the parser, checks the options and runs the command, and
re-exports these names). Like it, this module imports nothing heavy: ``--help`` costs no torch import.
"""

from __future__ import annotations

import argparse

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
    "flashdora_split",
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
