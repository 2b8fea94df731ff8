"""``flashdora bench serve`` (bench/serve.py, bench/serve_render.py) on the CPU: a row per (K, r, mode) with times,
the Markdown and PNG beside the JSON, the greedy tokens of flashdora's mixed batch equal to PEFT DoRA's per
sub-batch, and its options checked before any work."""

import json

import pytest

from flashdora.tools.bench.serve_render import MODES
from flashdora.tools.cli import UsageError, main

SMALL = [
    "--preset",
    "tiny",
    "--device",
    "cpu",
    "--adapters",
    "1,2",
    "--ranks",
    "4",
    "--requests",
    "4",
    "--prompt",
    "8",
]
SMALL += ["--new-tokens", "2", "--prefill-prompt", "8", "--reps", "1", "--warmup", "0"]


@pytest.mark.quick
def test_serve_writes_a_row_per_adapters_rank_and_mode(tmp_path, capsys):
    assert main(["bench", "serve", *SMALL, "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("*_cpu_serve.json")
    result = json.loads(json_path.read_text())
    assert result["bench"] == "serve" and result["command"][:3] == ["flashdora", "bench", "serve"]
    rows = result["rows"]
    assert sorted((r["adapters"], r["rank"], r["mode"]) for r in rows) == sorted(
        (k, 4, mode) for k in (1, 2) for mode in MODES
    )
    for row in rows:
        assert "error" not in row, row
        assert row["prefill_ms"] > 0 and row["decode_ms_per_token"] > 0 and row["decode_tokens_per_s"] > 0
        assert len(row["decode_times_ms"]) == 1 and row["peak_mem_gib"] is None  # (no CUDA: no peak)
        if row["mode"] == "peft_lora_one":
            assert row["prefill_vs_lora_one"] == row["decode_vs_lora_one"] == 1.0
        if row["mode"] == "flashdora_mixed":  # the fused mixed route, not PEFT's per-adapter loop
            assert row["paths"] and all(p.startswith("mixed") for p in row["paths"]), row["paths"]
    # float32 on the CPU: flashdora's mixed batch picks the same greedy tokens as PEFT DoRA per sub-batch
    assert [(c["adapters"], c["first_token_match"], c["token_match"]) for c in result["combos"]] == [
        (1, 1.0, 1.0),
        (2, 1.0, 1.0),
    ]
    md = json_path.with_suffix(".md").read_text()
    assert "| K | r | mode |" in md and all(f"| {mode} |" in md for mode in MODES)
    assert json_path.with_suffix(".png").stat().st_size > 0
    out = capsys.readouterr()
    assert "flashdora_mixed" in out.out and "wrote " in out.out
    assert "bench serve: K=2 r=4 rep 1/1" in out.err  # a progress line per (K, r, step)


BAD = [
    pytest.param(["--modes", "bogus"], r"argument --modes: invalid choice 'bogus'", id="modes"),
    pytest.param(["--modes", "peft_lora_one,peft_dora"], r"--modes: invalid choice 'peft_dora'", id="modes-commas"),
    pytest.param(
        ["--modes", "flashdora_mixed", "flashdora_mixed"], "--modes: 'flashdora_mixed' given twice", id="twice"
    ),
    pytest.param(["--adapters", "1,x"], "--adapters: expected integers such as 1,4,16, got '1,x'", id="adapters-int"),
    pytest.param(["--adapters", "1", "0"], r"--adapters expected values >= 1, got \[1, 0\]", id="adapters"),
    pytest.param(["--ranks", "0"], r"--ranks expected values >= 1, got \[0\]", id="ranks"),
    pytest.param(["--adapters", "8", "--requests", "4"], r"--adapters expected values <= --requests \(4", id="k>n"),
    pytest.param(["--prefill-prompt", "0"], "--prefill-prompt expected >= 1, got 0", id="prefill-prompt"),
    pytest.param(["--new-tokens", "0"], "--new-tokens expected >= 1, got 0", id="new-tokens"),
    pytest.param(["--warmup", "-1"], "--warmup expected >= 0, got -1", id="warmup"),
    pytest.param(["--config", "missing.json"], "--config missing.json: no such file", id="config"),
]


@pytest.mark.quick
@pytest.mark.parametrize(("argv", "message"), BAD)
def test_bad_serve_options_fail_at_once_naming_the_option(argv, message, capsys, no_command_runs):
    with pytest.raises(UsageError, match=message) as exit_info:
        main(["bench", "serve", "--device", "cpu", *argv])
    assert exit_info.value.code == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("flashdora bench serve: error: ") and "--" in first


def test_serve_help_lists_the_modes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(mode in text for mode in MODES) and "--prefill-prompt" in text
