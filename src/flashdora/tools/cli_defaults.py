"""Defaults that depend on the device: GPU-sized on CUDA, small on the CPU, where ``flashdora bench`` only shows that
the code runs (CPU timings are not benchmarks). The options are declared with ``None`` (``cli_args``) and filled here
once ``--device`` is known (``flashdora.tools.cli.check``); a value given on the command line is kept.

Result files go to ``./flashdora-bench/`` unless ``--out`` names a folder; the repository's ``benchmarks/results/``
holds the evidence the docs cite and is written only when asked (``--out benchmarks/results``).
"""

from __future__ import annotations

import argparse

from flashdora.tools.cli_args import LAYER_RANKS, LAYER_SHAPES, LAYER_TOKENS, parse_shape

OUT = "flashdora-bench"
LAYER_SHAPES_CPU = ("256x512", "512x256")
LAYER_RANKS_CPU = (8,)
LAYER_TOKENS_CPU = (64,)
PRESET_CPU = "tiny"

# command -> {option dest: (on CUDA, on the CPU)}
DEVICE_DEFAULTS = {
    "bench layer": {
        "shapes": ([parse_shape(s) for s in LAYER_SHAPES], [parse_shape(s) for s in LAYER_SHAPES_CPU]),
        "ranks": (list(LAYER_RANKS), list(LAYER_RANKS_CPU)),
        "tokens": (list(LAYER_TOKENS), list(LAYER_TOKENS_CPU)),
        "norm_shape": ((8192, 28672), (512, 1024)),
        "norm_rank": (384, 16),
    },
    "bench model": {"preset": ("llama3-8b", PRESET_CPU), "seq": (2048, 128)},
    "bench fsdp": {"preset": ("llama3-8b", PRESET_CPU), "seq": (2048, 128), "ranks": ([384, 16], [16])},
    "bench serve": {"preset": ("llama3-8b", PRESET_CPU), "prompt": (128, 32), "prefill_prompt": (512, 64)},
}


def resolve(args: argparse.Namespace) -> None:
    """Fill the options left unset (``None``) with their default for ``args.device`` (already resolved)."""
    on_cpu = str(getattr(args, "device", None)) == "cpu"
    for dest, (cuda, cpu) in DEVICE_DEFAULTS.get(args._command, {}).items():
        if getattr(args, dest) is None:
            setattr(args, dest, cpu if on_cpu else cuda)
    if getattr(args, "out", "") is None:
        args.out = OUT
