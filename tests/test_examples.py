"""The examples run as-is (CPU, a few steps) and really go through flashdora."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_train_with_trainer_runs_flashdora():
    cmd = [sys.executable, str(EXAMPLES / "train_with_trainer.py"), "--max-steps", "2", "--batch", "2", "--seq", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"CUDA_VISIBLE_DEVICES": "", **_env()})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Trainer: mean training loss" in proc.stdout
    assert "'eager':" in proc.stdout or "'triton':" in proc.stdout  # the path counters show flashdora ran


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
