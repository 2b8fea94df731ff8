"""FSDP2 on the CPU: ``examples/fsdp2_train.py`` under ``torchrun`` with two gloo processes."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_train.py"


def _losses(*extra: str) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(EXAMPLE), "--device", "cpu"]
    out = subprocess.run([*cmd, "--steps", "3", *extra], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"^step \d+: loss ([0-9.]+)", out.stdout, re.M)]
    assert len(losses) == 3, out.stdout
    return losses


@pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo")
def test_fsdp2_trains_as_peft_does():
    """Two processes, every decoder layer and the root sharded, flashdora enabled after ``fully_shard``: the same
    losses as PEFT's own DoRA under the same sharding, steps after optimizer steps included (a stale norm after
    FSDP2 re-fills its unsharded storage would show from step 1 on)."""
    flash, peft = _losses(), _losses("--no-flashdora")
    assert peft[0] != peft[-1]  # the weights moved
    for a, b in zip(flash, peft):
        assert abs(a - b) <= 1e-5 * abs(b)
