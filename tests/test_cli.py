import pytest

from flashdora.cli import build_parser, main


def test_demo_runs_and_prints_the_table(capsys):
    assert main(["demo", "--size", "tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--rank", "4"]) == 0
    out = capsys.readouterr().out
    assert "PEFT DoRA" in out and "flashdora" in out and "max |delta loss|" in out
    delta = float(out.split("max |delta loss| over 2 steps: ")[1].split()[0])
    assert delta < 1e-5


def test_demo_rejects_bad_arguments():
    with pytest.raises(SystemExit, match="--steps, --batch and --rank must be >= 1"):
        main(["demo", "--size", "tiny", "--steps", "0"])


def test_every_subcommand_has_help():
    parser = build_parser()
    for argv in (["demo", "--help"], ["parity", "--help"], ["bench", "layer", "--help"], ["bench", "model", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 0
