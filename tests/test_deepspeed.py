"""DeepSpeed: ZeRO-3 partitions every parameter and gathers it in module hooks, so flashdora sends every DoRA layer to
PEFT's own forward (``peft_fallback:deepspeed_zero3``) and trains exactly as PEFT does; under ZeRO-2 it runs its own
path. Two ranks on the CPU (gloo, DeepSpeed's CPU accelerator; ``tests/ds_worker.py``), and the ZeRO-3 check in one
process on parameters tagged as DeepSpeed tags them."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashdora
from flashdora import backend
from tests.helpers import rel_err
from tests.peft_models import llama, make_ids, unpatched  # noqa: F401 - the autouse fixture: PEFT runs its own code

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (pip install deepspeed; scripts/test.sh installs it with the test extras)",
)
CASES = ("zero3", "zero3-after", "zero3-accelerate", "zero2", "zero3-trainer")


def _worker(*args: str, env: dict[str, str] | None = None) -> str:
    cmd = [*TORCHRUN, str(ROOT / "tests" / "ds_worker.py"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@needs_deepspeed
@pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo")
def test_deepspeed_trains_like_peft_on_two_cpu_ranks():
    """Two ranks on the CPU, 3 AdamW steps, fp32, gradient checkpointing on: under ZeRO-3 (``deepspeed.initialize``
    with flashdora enabled before or after it, accelerate's ``DeepSpeedPlugin(zero_stage=3)``, and the Trainer with
    the model built under ``deepspeed.zero.Init``) the parameters are partitioned at rest, every DoRA call runs PEFT's
    forward (counted ``peft_fallback:deepspeed_zero3``, one warning, named by ``report()``; no flashdora op ran), and
    losses and adapter weights equal PEFT's under the same config and in one process; under ZeRO-2 flashdora's own
    path, one norm per layer per step and one ``||W||^2`` per frozen base, with the same results. (The checks are the
    worker's.)"""
    out = _worker(env={"DS_ACCELERATOR": "cpu"})
    assert all(f"OK {case}\n" in out for case in CASES), out


@pytest.mark.gpu2
@needs_deepspeed
def test_deepspeed_trains_like_peft_on_two_gpus():
    """The same on two GPUs (NCCL): ZeRO-3 on PEFT's route, ZeRO-2 on the Triton path."""
    out = _worker("--device", "cuda")
    assert all(f"OK {case}\n" in out for case in CASES), out


def test_zero3_parameters_run_peft_forward():
    """A layer whose parameters carry DeepSpeed's ZeRO-3 tag (``ds_id``, set on every parameter it partitions) runs
    PEFT's forward with its own counted reason, even with no hook in sight: outside its hooks' gathers such a
    parameter is empty. (Tagged by hand here, whole: the same output as PEFT's own.)"""
    model = llama(dropout=0.0)
    ids = make_ids(model.config.vocab_size)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    flashdora.enable(model)
    tagged = [p for n, p in model.named_parameters() if "base_layer.weight" in n]
    for i, p in enumerate(tagged):
        p.ds_id = i
    flashdora.reset_stats()
    backend._warned.discard("fallback:deepspeed_zero3")
    with pytest.warns(UserWarning, match="deepspeed_zero3"):
        with torch.no_grad():
            got = model(input_ids=ids).logits
    assert rel_err(got, want) < 1e-6
    assert flashdora.stats() == {"peft_fallback:deepspeed_zero3": len(tagged)}
    assert f"DoRA layers by path: peft:deepspeed_zero3: {len(tagged)}" in flashdora.report(model, print_table=False)
    for p in tagged:
        del p.ds_id
    flashdora.reset_stats()
    with torch.no_grad():
        model(input_ids=ids)
    assert not any(k.startswith("peft_fallback") for k in flashdora.stats())  # untagged: flashdora's path again
