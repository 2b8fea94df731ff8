"""``flashdora ... --help`` builds its parsers without torch, and every option says what it does."""

import argparse
import json
import subprocess
import sys

import pytest

from flashdora.tools import cli

COMMANDS = [[], ["demo"], ["parity"], ["bench"], ["bench", "layer"], ["bench", "model"]]
HEAVY = ("torch", "transformers", "peft", "triton", "matplotlib", "rich")

# Runs ``python -m flashdora.cli <command> --help`` for each command in one process and prints, per command, the exit
# code and the heavy modules imported by then. ``stub``: the package's ``__init__`` is skipped, so that what is
# checked is the CLI alone.
_PROBE = """
import importlib.util, json, runpy, sys, types
commands, stub, heavy = json.loads(sys.argv[1])
if stub:
    spec = importlib.util.find_spec("flashdora")
    package = types.ModuleType("flashdora")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["flashdora"] = package
out = []
for command in commands:
    sys.argv = ["flashdora", *command, "--help"]
    try:
        runpy.run_module("flashdora.cli", run_name="__main__", alter_sys=True)
        code = None
    except SystemExit as e:
        code = e.code
    out.append({"command": command, "code": code, "heavy": [m for m in heavy if m in sys.modules]})
print(json.dumps(out))
"""


def _probe(commands, stub: bool) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps([commands, stub, HEAVY])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "flashdora")
def test_help_imports_nothing_heavy(command):
    (got,) = _probe([command], stub=True)
    assert got["code"] == 0
    assert got["heavy"] == [], f"flashdora {' '.join(command)} --help imported {got['heavy']}"


@pytest.fixture(scope="module")
def unstubbed():
    return _probe(COMMANDS, stub=False)


def test_every_help_exits_zero_as_a_module(unstubbed):
    assert [r["code"] for r in unstubbed] == [0] * len(COMMANDS)


def test_help_imports_no_torch_through_the_package(unstubbed):
    assert all("torch" not in r["heavy"] for r in unstubbed), unstubbed


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_has_help():
    seen = 0
    for parser in _parsers(cli.build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            seen += 1
            assert action.help and action.help.strip(), f"{parser.prog}: {action.option_strings or action.dest}"
            if isinstance(action, argparse._SubParsersAction):
                assert all(a.help for a in action._choices_actions), parser.prog
    assert seen > 60


def test_choices_match_the_modules_that_use_them():
    from flashdora.tools import demo, parity
    from flashdora.tools.bench import fsdp, layer, layer_render, model_build, model_render

    assert set(cli.DEMO_SIZES) == set(demo.SIZES)
    assert cli.PARITY_DTYPES == parity.MODES
    assert (cli.LAYER_MODES, cli.LAYER_PHASES) == (layer_render.MODES, layer_render.PHASES)
    assert (cli.MODEL_MODES, cli.MODEL_PHASES) == (model_render.MODES, model_render.PHASES)
    assert set(cli.MODEL_PRESETS) == set(model_build.PRESETS)
    assert cli.FSDP_MODES == fsdp.MODES
    assert layer.DTYPES == cli.LAYER_DTYPES and layer.parse_shape is cli.parse_shape
