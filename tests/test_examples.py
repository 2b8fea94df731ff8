"""The examples run as-is (CPU, a few steps) and really go through flashdora (the README's snippets:
tests/test_docs.py)."""

import ast
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


def test_trainer_recomputes_the_norm_after_every_optimizer_step():
    # HF Trainer's default optimizer is fused AdamW, which moves no version counter: the norm cache must still see
    # each step (one forward per step here, so one norm computation per layer and forward).
    cmd = [sys.executable, str(EXAMPLES / "train_with_trainer.py"), "--max-steps", "3", "--batch", "2", "--seq", "32"]
    proc = subprocess.run(cmd + ["--skip-trl"], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    counters = ast.literal_eval(proc.stdout.split("flashdora path counters: ")[-1].strip().splitlines()[0])
    forwards = counters.get("eager", 0) + counters.get("triton", 0)
    norms = counters.get("norm:eager", 0) + counters.get("norm:triton", 0)
    assert forwards > 0 and norms == forwards, counters


def test_serve_adapters_matches_peft_per_request():
    cmd = [sys.executable, str(EXAMPLES / "serve_adapters.py"), "--new-tokens", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"CUDA_VISIBLE_DEVICES": "", **_env()})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tokens equal to PEFT's per request: True" in proc.stdout
    assert "'mixed-eager':" in proc.stdout  # the fused mixed path ran


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
