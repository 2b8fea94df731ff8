"""``flashdora`` command line: ``build``, ``demo``, ``parity``, ``bench layer|model|fsdp|serve``; each module does
the work.

The parsers are assembled here from plain constants and the per-command ``add_*_arguments`` of
``flashdora.tools.cli_args`` and ``flashdora.tools.cli_bench_args`` (re-exported here), so ``--help`` and a bad option
cost no torch import (the modules behind the commands import torch, transformers and peft). ``main`` checks the
options (``check``) before it imports the command's module and calls its ``run(args)``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path

from flashdora.tools import cli_defaults
from flashdora.tools.cli_args import (  # noqa: F401 - the options live in cli_args; re-exported for callers
    DEMO_SIZES,
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
    PARITY_DTYPES,
    SERVE_MODES,
    add_demo_arguments,
    add_dropout_study_arguments,
    add_parity_arguments,
    parse_shape,
)
from flashdora.tools.cli_bench_args import (  # noqa: F401 - re-exported for callers
    add_fsdp_arguments,
    add_layer_arguments,
    add_model_arguments,
    add_serve_arguments,
    parse_range,
)

# command -> its options
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

# command -> module with run(args) -> int, and its one-line help
_COMMANDS = {
    "build": ("flashdora.tools.build", "build the C++ extension into torch's extension cache now (images, CI)"),
    "demo": ("flashdora.tools.demo", "train a small Llama-style model with PEFT DoRA and with flashdora; compare"),
    "parity": ("flashdora.tools.parity", "logit fidelity vs PEFT and float64, and training-curve parity"),
    "dropout-study": (
        "flashdora.tools.parity_dropout",
        "held-out loss after training with PEFT DoRA (exact dropout), flashdora's adapter dropout and PEFT LoRA",
    ),
    "bench layer": ("flashdora.tools.bench.layer", "one DoRA layer: PEFT LoRA vs PEFT DoRA vs flashdora (GPU)"),
    "bench model": ("flashdora.tools.bench.model", "a whole model from a transformers config: modes x phases (GPU)"),
    "bench fsdp": ("flashdora.tools.bench.fsdp", "a training step under FSDP2 on several GPUs (torchrun inside)"),
    "bench serve": (
        "flashdora.tools.bench.serve",
        "several adapters in one batch: prefill and decode, PEFT LoRA and DoRA vs flashdora's mixed batch (GPU)",
    ),
}
_GROUPS = {"bench": "GPU benchmarks against PEFT"}
# command -> (optional packages it needs, the pyproject extra that brings them)
_NEEDS = {
    "build": ((), ""),
    "demo": (("rich",), "cli"),
    "parity": (("rich", "matplotlib"), "bench"),
    "dropout-study": (("rich", "matplotlib"), "bench"),
    "bench layer": (("rich", "matplotlib"), "bench"),
    "bench model": (("rich", "matplotlib"), "bench"),
    "bench fsdp": (("matplotlib",), "bench"),
    "bench serve": (("rich", "matplotlib"), "bench"),
}


class UsageError(SystemExit):
    """``parser.error``'s exit (status 2) that keeps its message, so a caller of ``main`` sees why, not just ``2``."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """The error on the first line and a pointer to ``--help`` on the second, instead of the usage block."""
        print(f"{self.prog}: error: {message}\n{help_pointer(self.prog)}", file=sys.stderr)
        raise UsageError(message)


def help_pointer(prog: str) -> str:
    return f"(options: {prog} --help)"


def build_parser() -> argparse.ArgumentParser:
    """The ``flashdora`` parser; imports nothing heavy."""
    parser = _Parser(prog="flashdora", description="DoRA at the cost of LoRA, for PEFT users.")
    groups = {"": parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to run")}
    for command, (module, help_text) in _COMMANDS.items():
        group, _, name = command.rpartition(" ")
        if group not in groups:  # ``bench``: a command of commands
            g = groups[""].add_parser(group, help=_GROUPS[group], description=_GROUPS[group])
            groups[group] = g.add_subparsers(dest=group, required=True, metavar=group.upper(), help="what to run")
        p = groups[group].add_parser(name, help=help_text, description=help_text)
        _ADD[command](p)
        p.set_defaults(_module=module, _command=command, _parser=p)
    return parser


# command -> {option dest: least value}; a list option's every value is checked
_AT_LEAST = {
    "build": {},
    "demo": {"steps": 1, "batch": 1, "seq": 1, "rank": 1},
    "parity": {"steps": 1, "seeds": 1, "first_seed": 0, "pretrain": 0, "rank": 1, "seq": 1, "batch": 1},
    "dropout-study": {
        **{k: 1 for k in ("steps", "seeds", "rank", "seq", "batch", "heldout_batches")},
        **{k: 0 for k in ("first_seed", "pretrain")},
    },
    "bench layer": {"ranks": 1, "tokens": 1, "reps": 1, "warmup": 0, "rounds": 1, "norm_rank": 1},
    "bench model": {
        **{k: 1 for k in ("layers", "rank", "batch", "seq", "prompt", "new_tokens", "reps", "rounds", "grad_accum")},
        "warmup": 0,
    },
    "bench fsdp": {**{k: 1 for k in ("nproc", "layers", "ranks", "seq", "batch", "reps")}, "warmup": 0},
    "bench serve": {
        **{
            k: 1 for k in ("layers", "adapters", "ranks", "requests", "prompt", "new_tokens", "prefill_prompt", "reps")
        },
        "warmup": 0,
    },
}
_POSITIVE = {"parity": ("lr", "pretrain_lr", "lora_b_ratio"), "bench fsdp": ("lr", "row_timeout")}  # finite floats > 0
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_values(args: argparse.Namespace, error) -> None:
    """Integers below their least value, non-positive rates, a dropout outside [0, 1)."""
    for dest, least in _AT_LEAST[args._command].items():
        value = getattr(args, dest)
        values = value if isinstance(value, list) else [] if value is None else [value]
        if any(v < least for v in values):
            error(f"{_option(dest)} expected {'values ' if isinstance(value, list) else ''}>= {least}, got {value}")
    for dest in _POSITIVE.get(args._command, ()):
        value = getattr(args, dest)
        if not (math.isfinite(value) and value > 0):
            error(f"{_option(dest)} expected a finite number > 0, got {value}")
    dropout = getattr(args, "dropout", 0.0)
    if not 0 <= dropout < 1:
        error(f"--dropout expected 0 <= p < 1, got {dropout}")


def _check_combinations(args: argparse.Namespace, error) -> None:
    """Options that exclude each other, and files that must exist."""
    if args._command == "bench layer" and args.interleave and args.rounds > 1:
        error(f"--interleave times the modes call by call; it takes no --rounds (got {args.rounds}): raise --reps")
    if args._command == "bench layer" and args.kernels_only and args.no_kernels:
        error("--kernels-only runs only the kernel sections, which --no-kernels skips: give one of them")
    if args._command == "bench model":
        if args.interleave and args.rounds > 1:
            error(f"--interleave times the modes step by step; it takes no --rounds (got {args.rounds}): raise --reps")
        if args.rounds > 1 and args.compile:
            error("--rounds > 1 with --compile would recompile every mode in every round; use 1")
        if args.dynamic is not None:
            if not args.interleave:
                error("--dynamic draws a token count per timed step for every mode at once: it needs --interleave")
            if not set(args.phases) <= {"grad", "train"}:
                error(f"--dynamic times the grad and train phases; got --phases {' '.join(args.phases)}")
            if args.compile:
                error("--dynamic with --compile would time recompilations at every new token count; run it without")
        if args.compile and getattr(args, "host", False):
            error(
                "--host times the layers' Python forwards, which a compiled model does not run; "
                "run it without --compile"
            )
        if args.compile and "decode" in args.phases:
            error("--compile does not reach generate's forward passes; run decode without it")
        if args.quant != "none" and importlib.util.find_spec("bitsandbytes") is None:
            error(f"--quant {args.quant} needs bitsandbytes: pip install bitsandbytes")
    if args._command == "bench serve" and max(args.adapters) > args.requests:
        error(
            f"--adapters expected values <= --requests ({args.requests}, a request per adapter), got {args.adapters}"
        )
    if getattr(args, "config", None) is not None and not args.config.is_file():
        error(f"--config {args.config}: no such file")
    for path in getattr(args, "merge", None) or ():
        if not Path(path).is_file():
            error(f"--merge {path}: no such file")


def _check_device(args: argparse.Namespace, error) -> None:
    """``--device`` names a device this machine has; unset, it becomes cuda when available, else cpu."""
    if args.device is not None and not _DEVICE.fullmatch(args.device):
        error(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if args.device == "cpu":
        return
    import torch  # only here: --help and the checks above need no torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif not torch.cuda.is_available():
        error(f"--device {args.device}: CUDA is not available on this machine (torch.cuda.is_available() is False)")
    elif ":" in args.device and int(args.device.split(":")[1]) >= torch.cuda.device_count():
        error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _check_packages(args: argparse.Namespace, error) -> None:
    """The optional packages the command needs are installed (found, not imported)."""
    packages, extra = _NEEDS[args._command]
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        error(f"flashdora {args._command} needs {' and '.join(missing)}: pip install 'flashdora[{extra}]'")


def check(args: argparse.Namespace) -> None:
    """Validate parsed options before any work (``parser.error``: exit 2, the option named); resolves ``--device``."""
    error = args._parser.error
    _check_packages(args, error)
    _check_values(args, error)
    _check_combinations(args, error)
    if hasattr(args, "device") and not getattr(args, "merge", None):  # (a merge's device comes from its files)
        _check_device(args, error)
    cli_defaults.resolve(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # reported by the command's own parser, so the pointer names its --help
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    device_given = getattr(args, "device", None) is not None
    check(args)
    args._argv = ["flashdora", *argv]  # the exact command, for result files
    announce(args, device_given)
    return _run(args)


def announce(args: argparse.Namespace, device_given: bool) -> None:
    """Before any work: a benchmark on the CPU says so first, and a command that writes result files says where."""
    if args._command.startswith("bench") and getattr(args, "device", None) == "cpu":
        how = "--device cpu" if device_given else "no CUDA device found; --device cuda on a GPU machine"
        print(f"flashdora {args._command}: running on the CPU ({how}): timings are not GPU numbers", flush=True)
    if getattr(args, "out", None) is not None:
        print(f"flashdora {args._command}: result files go to {Path(args.out).resolve()}/", flush=True)


def _run(args: argparse.Namespace) -> int:
    """Import the command's module (torch, transformers and peft come with it) and run it."""
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
