"""``flashdora`` command line: ``demo``, ``bench layer``, ``bench model``, ``parity``; each module does the work."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
_COMMANDS = {
    "demo": ("flashdora.demo", "train a small Llama-style model with PEFT DoRA and with flashdora; compare"),
    "parity": ("flashdora.parity", "logit fidelity vs PEFT and float64, and training-curve parity"),
}
_BENCH = {
    "layer": ("flashdora.bench.layer", "one DoRA layer: PEFT LoRA vs PEFT DoRA vs flashdora (GPU)"),
    "model": ("flashdora.bench.model", "a whole model from a transformers config: modes x phases (GPU)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdora", description="DoRA at the cost of LoRA, for PEFT users.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    bench = sub.add_parser("bench", help="GPU benchmarks against PEFT").add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in _BENCH.items():
        p = bench.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args._argv = ["flashdora", *argv]  # the exact command, for result files
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
