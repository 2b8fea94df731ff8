"""Result files written outside a git checkout (an sdist, a wheel, a tarball): no commit, and nothing breaks."""

import shutil
import subprocess

import pytest

from flashdora.tools import parity_render
from flashdora.tools.bench import record


def _result(commit, sources=None) -> dict:
    result = {
        "bench": "parity",
        "command": ["flashdora", "parity"],
        "commit": commit,
        "dirty": None,
        "timestamp": "2026-01-02T03:04:05+00:00",
        "device": {"type": "cpu", "name": "x86_64", "capability": None, "memory_gib": None},
        "versions": {k: "1" for k in ("python", "torch", "cuda", "triton", "transformers", "peft", "flashdora")},
        "protocol": {"reps": 1},
        "settings": {k: 1 for k in ("size", "rank", "dropout", "steps", "seeds", "batch", "seq", "dtype", "lr")},
        "checks": [{"name": "cosine", "value": 0.99999999, "op": ">=", "bar": 0.99999, "passed": True}],
        "training": {"mean_abs_delta": 1e-6, "max_abs_delta": 2e-6},
    }
    if sources is not None:
        result["sources"] = sources
    return result


def test_git_state_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHDORA_COMMIT", raising=False)
    monkeypatch.setattr(record, "_REPO", tmp_path)
    assert record.git_state() == (None, None)


def test_git_state_does_not_take_an_enclosing_repositorys_commit(tmp_path, monkeypatch):
    """An install inside another checkout (a venv in a project) is not that project's commit."""
    monkeypatch.delenv("FLASHDORA_COMMIT", raising=False)
    if shutil.which("git") is None:
        pytest.skip("no git here")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "enclosing project"], check=True)
    installed = tmp_path / "venv" / "lib" / "python3"
    installed.mkdir(parents=True)
    monkeypatch.setattr(record, "_REPO", installed)
    assert record.git_state() == (None, None)


def test_markdown_renders_without_a_commit():
    md = parity_render.render_markdown(_result(None))
    assert "- commit: unknown;" in md


def test_merged_markdown_renders_sources_without_a_commit():
    sources = [
        {"file": "a.json", "commit": None, "command": ["flashdora", "parity"]},
        {"file": "b.json", "commit": "0123456789abcdef", "command": ["flashdora", "parity"]},
    ]
    md = parity_render.render_markdown(_result(None, sources))
    assert "[a.json](a.json) (unknown), [b.json](b.json) (0123456)" in md
