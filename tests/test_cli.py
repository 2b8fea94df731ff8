import re
import subprocess
import sys

import pytest
import torch

from flashdora.tools import cli
from flashdora.tools.cli import UsageError, build_parser, main


def test_demo_runs_and_prints_the_table(capsys):
    argv = ["demo", "--size", "tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--rank", "4", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())  # (rich wraps at the terminal's width)
    assert "PEFT DoRA" in out and "flashdora (eager)" in out and "max |delta loss|" in text
    delta = float(text.split("max |delta loss| over 2 steps: ")[1].split()[0])
    assert delta < 1e-5
    # CPU timings are noise next to the product's claim: no ratio, and the output says why
    assert "speed-up: not measured on the CPU" in text
    assert not re.search(r"\d\.\d+x", text), "the demo printed a speed-up ratio on the CPU"
    assert "note: on cpu flashdora ran its eager path (plain PyTorch), not its Triton kernels on a GPU" in text
    assert "CPU timings are not flashdora's claim" in text and "no speed-up is printed" in text


def test_demo_speed_note_names_the_path():
    from flashdora.tools.demo import flashdora_path, speed_note

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert flashdora_path(cuda, {"triton": 3, "norm:triton": 3}) is None  # the real thing: no note
    assert flashdora_path(cuda, {"eager": 3}) == "eager"
    assert flashdora_path(cpu, {"eager": 3}) == "eager"
    assert flashdora_path(cpu, {"triton": 3}) == "Triton interpreter"
    assert "FLASHDORA_BACKEND=eager" in speed_note(cuda, "eager")
    assert "under the Triton interpreter" in speed_note(cpu, "Triton interpreter")


def test_demo_prints_a_speed_up_on_cuda_only():
    from flashdora.tools.demo import speed_up

    assert speed_up(torch.device("cuda"), None, 30.0, 10.0) == "speed-up 3.00x"
    assert speed_up(torch.device("cuda"), "eager", 30.0, 10.0) == "speed-up (eager, cuda) 3.00x"
    for path in ("eager", "Triton interpreter"):
        line = speed_up(torch.device("cpu"), path, 30.0, 10.0)
        assert line.startswith("speed-up: not measured on the CPU") and not re.search(r"\dx", line)


def test_every_subcommand_has_help():
    parser = build_parser()
    for argv in (["demo", "--help"], ["parity", "--help"], ["bench", "layer", "--help"], ["bench", "model", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 0


BAD = [
    pytest.param(["demo", "--steps", "0"], "--steps expected >= 1, got 0", id="demo-steps"),
    pytest.param(["demo", "--rank", "-4"], "--rank expected >= 1, got -4", id="demo-rank"),
    pytest.param(["demo", "--seq", "0"], "--seq expected >= 1, got 0", id="demo-seq"),
    pytest.param(["demo", "--dropout", "1.5"], r"--dropout expected 0 <= p < 1, got 1.5", id="demo-dropout"),
    pytest.param(["parity", "--seeds", "0"], "--seeds expected >= 1, got 0", id="parity-seeds"),
    pytest.param(["parity", "--first-seed", "-1"], "--first-seed expected >= 0, got -1", id="parity-first-seed"),
    pytest.param(["parity", "--lr", "0"], "--lr expected a finite number > 0, got 0.0", id="parity-lr"),
    pytest.param(["parity", "--lr", "nan"], "--lr expected a finite number > 0, got nan", id="parity-lr-nan"),
    pytest.param(["bench", "fsdp", "--lr", "0"], "--lr expected a finite number > 0, got 0.0", id="fsdp-lr"),
    pytest.param(["parity", "--lora-b-ratio", "-1"], "--lora-b-ratio expected a finite", id="parity-ratio"),
    pytest.param(["parity", "--merge", "missing.json"], "--merge missing.json: no such file", id="parity-merge"),
    pytest.param(["bench", "layer", "--ranks", "16", "0"], r"--ranks expected values >= 1, got \[16, 0\]", id="ranks"),
    pytest.param(["bench", "layer", "--tokens", "-8"], r"--tokens expected values >= 1, got \[-8\]", id="tokens"),
    pytest.param(["bench", "layer", "--reps", "0"], "--reps expected >= 1, got 0", id="layer-reps"),
    pytest.param(["bench", "layer", "--warmup", "-1"], "--warmup expected >= 0, got -1", id="layer-warmup"),
    pytest.param(["bench", "layer", "--norm-rank", "0"], "--norm-rank expected >= 1", id="layer-norm-rank"),
    pytest.param(["bench", "layer", "--shapes", "0x8"], "--shapes: shape expected positive sizes", id="shape"),
    pytest.param(["bench", "layer", "--interleave", "--rounds", "2"], "--interleave .* no --rounds", id="interleave"),
    pytest.param(["bench", "layer", "--kernels-only", "--no-kernels"], "--kernels-only .* --no-kernels skips",
                 id="kernels-only"),  # fmt: skip
    pytest.param(["bench", "model", "--rank", "0"], "--rank expected >= 1, got 0", id="model-rank"),
    pytest.param(["bench", "model", "--new-tokens", "0"], "--new-tokens expected >= 1, got 0", id="new-tokens"),
    pytest.param(["bench", "model", "--layers", "0"], "--layers expected >= 1, got 0", id="layers"),
    pytest.param(["bench", "model", "--grad-accum", "0"], "--grad-accum expected >= 1, got 0", id="grad-accum"),
    pytest.param(["bench", "model", "--config", "missing.json"], "--config missing.json: no such file", id="config"),
    pytest.param(["bench", "model", "--rounds", "2", "--compile"], "--rounds > 1 with --compile", id="rounds-compile"),
    pytest.param(["bench", "model", "--phases", "decode", "--compile"], "decode without it", id="decode-compile"),
    pytest.param(["bench", "model", "--device", "gpu"], "--device gpu: expected cpu, cuda or cuda:N", id="device"),
    pytest.param(["bench", "model", "--dynamic", "20-10"], "--dynamic: expected 1 <= LO <= HI", id="dynamic-order"),
    pytest.param(["bench", "model", "--dynamic", "20"], "--dynamic: expected LO-HI such as", id="dynamic-form"),
    pytest.param(["bench", "model", "--dynamic", "8-16"], "--dynamic .* needs --interleave", id="dynamic-alone"),
    pytest.param(["bench", "model", "--dynamic", "8-16", "--interleave"], "--dynamic times the grad and train phases",
                 id="dynamic-phases"),  # fmt: skip
]


@pytest.mark.parametrize(("argv", "message"), BAD)
def test_bad_options_fail_at_once_naming_the_option(argv, message, capsys, no_command_runs):
    with pytest.raises(UsageError, match=message) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    # the error first, then where the options are; not the usage block
    first, pointer = capsys.readouterr().err.splitlines()
    assert first.startswith("flashdora ") and first.endswith(": error: " + exit_info.value.message)
    assert pointer == f"(options: {first.split(': error: ')[0]} --help)"


def test_an_unknown_option_from_the_shell_prints_two_lines():
    proc = subprocess.run(
        [sys.executable, "-m", "flashdora.cli", "bench", "model", "--bogus"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "flashdora bench model: error: unrecognized arguments: --bogus",
        "(options: flashdora bench model --help)",
    ]


@pytest.mark.parametrize("command", [["demo"], ["parity"], ["bench", "layer"], ["bench", "model"]], ids=" ".join)
def test_cuda_device_without_cuda_fails_at_once(command, monkeypatch, capsys, no_command_runs):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError) as exit_info:
        main([*command, "--device", "cuda"])
    assert exit_info.value.code == 2
    expected = "--device cuda: CUDA is not available on this machine (torch.cuda.is_available() is False)"
    assert exit_info.value.message == expected
    assert capsys.readouterr().err.splitlines()[0].endswith(f"error: {expected}")


def test_cuda_index_beyond_the_machines_devices(monkeypatch, no_command_runs):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UsageError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\)"):
        main(["bench", "layer", "--device", "cuda:2"])


def test_device_defaults_to_cuda_when_available(monkeypatch):
    parser = build_parser()
    for available, expected in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        args = parser.parse_args(["bench", "model"])
        cli.check(args)
        assert args.device == expected


def test_cuda_device_without_cuda_from_the_shell():
    """The user's view: exit code 2, no traceback, and a first line that names the option."""
    code = "import sys, torch; torch.cuda.is_available = lambda: False; import flashdora.cli as c; sys.exit(c.main())"
    proc = subprocess.run(
        [sys.executable, "-c", code, "bench", "model", "--device", "cuda"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[0] == (
        "flashdora bench model: error: --device cuda: CUDA is not available on this machine "
        "(torch.cuda.is_available() is False)"
    )
    assert "Traceback" not in proc.stderr


def test_a_missing_optional_package_is_named_with_its_extra(monkeypatch, no_command_runs):
    find_spec = cli.importlib.util.find_spec
    no_matplotlib = lambda name: None if name == "matplotlib" else find_spec(name)  # noqa: E731
    monkeypatch.setattr(cli.importlib.util, "find_spec", no_matplotlib)
    with pytest.raises(UsageError, match=r"flashdora bench model needs matplotlib: pip install 'flashdora\[bench\]'"):
        main(["bench", "model", "--device", "cpu"])
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"flashdora demo needs rich: pip install 'flashdora\[cli\]'"):
        main(["demo", "--device", "cpu"])


def test_bench_on_the_cpu_says_so_first_and_announces_the_result_folder(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli, "_run", lambda args: 0)  # the announcement comes before any work
    assert main(["bench", "model", "--preset", "tiny", "--out", str(tmp_path / "r")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "flashdora bench model: running on the CPU (no CUDA device found; --device cuda on a GPU machine): "
        "timings are not GPU numbers"
    )
    assert lines[1] == f"flashdora bench model: result files go to {(tmp_path / 'r').resolve()}/"
    assert main(["bench", "layer", "--device", "cpu"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("flashdora bench layer: running on the CPU (--device cpu)")
    assert main(["demo", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == ""  # the demo writes no files and says on its own where it ran
