"""Shared by the bench tests: run ``flashdora bench`` into a folder, check a result's header, read a table row."""

import json

import torch

from flashdora.tools.cli import main

HEADER_KEYS = {"bench", "command", "args", "commit", "dirty", "timestamp", "device", "versions", "protocol"}
VERSION_KEYS = {"python", "torch", "cuda", "triton", "transformers", "peft", "flashdora"}
PROTOCOL_KEYS = {"warmup", "reps", "statistic", "timer"}


def run_bench(tmp_path, *argv) -> tuple[dict, dict]:
    """Run ``flashdora bench ...`` into ``tmp_path``; returns (result JSON, {suffix: path})."""
    assert main(["bench", *argv, "--device", "cpu", "--out", str(tmp_path)]) == 0
    files = {p.suffix: p for p in tmp_path.iterdir()}
    assert set(files) == {".json", ".md", ".png"}
    assert len({p.stem for p in files.values()}) == 1
    return json.loads(files[".json"].read_text()), files


def check_header(result: dict, bench: str, tmp_path) -> None:
    assert HEADER_KEYS <= set(result)
    assert result["bench"] == bench
    assert result["command"] and all(isinstance(a, str) for a in result["command"])
    assert result["args"]["out"] == str(tmp_path)
    assert VERSION_KEYS <= set(result["versions"])
    assert result["torch"] == torch.__version__ and result["peft"] and result["transformers"]
    assert PROTOCOL_KEYS <= set(result["protocol"])
    assert result["device"]["type"] == "cpu" and result["protocol"]["native_backward"] == "cpu"
    assert {"name", "capability", "memory_gib"} <= set(result["device"])
    assert (tmp_path / f"{result['timestamp'][:10]}_cpu_{bench}.json").exists()


def md_row(md: str, phase: str, mode: str) -> dict[str, str]:
    """The cells of the table row of ``phase`` and ``mode``, by column name."""
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[1:3] == [phase, mode]:
            return dict(zip(columns, cells, strict=True))
    raise AssertionError(f"no {phase} {mode} row in the table")
