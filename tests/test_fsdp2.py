"""Several processes on the CPU (gloo): FSDP2 and DDP (``tests/dist_worker.py``), ``examples/fsdp2_train.py`` as a
user runs it, and the FSDP2 shard tags of the norm cache in one process."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import flashdora
from tests.peft_models import unpatched  # noqa: F401 - the autouse fixture: PEFT runs its own code here

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
posix = pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo")


def _run(*cmd: str) -> str:
    out = subprocess.run([*TORCHRUN, *cmd], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@pytest.fixture(scope="module")
def workers_output() -> str:
    """``tests/dist_worker.py`` and then ``tests/mp_worker.py``'s check in one launch (``--mixed-precision``): the
    launch's start-up is most of either's time. Each test below reads its own lines."""
    return _run(str(ROOT / "tests" / "dist_worker.py"), "--mixed-precision")


@posix
def test_fsdp2_and_ddp_train_as_one_process_does(workers_output):
    """Two ranks under FSDP2 (every decoder layer and the root; enabled after or before the sharding, with and
    without resharding after the forward, from the meta device, with gradient accumulation) and under DDP, gradient
    checkpointing on: the losses and adapter weights of PEFT's DoRA in one process on the whole batch, one norm per
    layer per step and one ``||W||^2`` per frozen base, ``report()`` listing every layer as flashdora's, and no stale
    norm after an in-place edit or a load between steps."""
    out = workers_output
    assert all(f"OK {wrap}\n" in out for wrap in ("fsdp2", "fsdp2-early", "fsdp2-meta", "fsdp2-accum", "ddp")), out


@pytest.mark.gpu2
def test_fsdp2_and_ddp_on_two_gpus():
    """The same on two GPUs (NCCL): the Triton path and its fused kernels."""
    out = _run(str(ROOT / "tests" / "dist_worker.py"), "--device", "cuda")
    assert "OK fsdp2" in out and "OK ddp" in out, out


@posix
def test_bf16_mixed_precision_trains_like_float32(workers_output):
    """Under FSDP2's bf16 ``MixedPrecisionPolicy`` flashdora's loss curve stays with the float32 run's where PEFT's
    DoRA lags behind it (``tests/mp_worker.py``: two ranks, 4 steps; the worker checks both)."""
    assert "OK mixed-precision" in workers_output, workers_output


@pytest.mark.gpu2
def test_bf16_mixed_precision_on_two_gpus():
    out = _run(str(ROOT / "tests" / "mp_worker.py"), "--device", "cuda", "--steps", "12")  # (as the H200s ran it)
    assert "OK mixed-precision" in out, out


@posix
def test_fsdp2_example_runs_as_written():
    out = _run(str(ROOT / "examples" / "fsdp2_train.py"), "--device", "cpu", "--steps", "2", "--checkpointing")
    losses = [float(m) for m in re.findall(r"^step \d+: loss ([0-9.]+)", out, re.M)]
    assert len(losses) == 2, out
    assert "'norm:eager': 28" in out, out  # 2 layers x 7 projections x 2 steps: once a step, recomputation included


def _accelerate_trainer() -> str:
    config = str(ROOT / "examples" / "accelerate_fsdp2.yaml")
    example = [str(ROOT / "examples" / "train_with_trainer.py"), "--skip-trl", "--max-steps", "2", "--batch", "2"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, *example, "--seq", "32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.count("Trainer: mean training loss") == 2, out.stdout  # both ranks trained
    assert "'norm:" in out.stdout, out.stdout  # and went through flashdora
    return out.stdout


@posix
def test_accelerate_config_runs_the_trainer_example():
    """``examples/accelerate_fsdp2.yaml`` as the README gives it (on the CPU accelerate runs the Trainer's DDP)."""
    pytest.importorskip("accelerate")
    _accelerate_trainer()


@pytest.mark.gpu2
def test_accelerate_config_shards_with_fsdp2_on_two_gpus():
    out = _accelerate_trainer()
    assert "Trainer: FSDP2," in out, out


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 24)

    def forward(self, x):
        return self.proj(x)


@posix
def test_bench_fsdp_on_two_cpu_processes(tmp_path):
    """``flashdora bench fsdp`` end to end on the CPU: a row per mode, one norm per layer per step for flashdora."""
    import json

    cmd = ["-m", "flashdora.cli", "bench", "fsdp", "--preset", "tiny", "--device", "cpu", "--nproc", "2", "--ranks",
           "4", "--reps", "2", "--warmup", "0", "--seq", "16", "--mp", "off", "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    (path,) = tmp_path.glob("*_fsdp.json")
    rows = {r["mode"]: r for r in json.loads(path.read_text())["records"]}
    assert set(rows) == {"peft_lora", "peft_dora", "flashdora"} and all(r["ms"] > 0 for r in rows.values())
    assert rows["flashdora"]["norms_per_step"] == 14 and rows["peft_dora"]["norms_per_step"] is None
    assert "| tiny | 4 | off | flashdora |" in path.with_suffix(".md").read_text()
    assert all(len(r["losses"]) == 3 for r in rows.values())  # the first step and the 2 timed ones


@posix
def test_bench_fsdp_interleave_times_every_mode_in_one_launch(tmp_path):
    """``--interleave``: one launch per rank holding a model per mode, each timed step running every mode once; each
    mode's row as without it (its own losses, one norm per layer per step for flashdora)."""
    import json

    cmd = ["-m", "flashdora.cli", "bench", "fsdp", "--preset", "tiny", "--device", "cpu", "--nproc", "2", "--ranks",
           "4", "--reps", "2", "--warmup", "0", "--seq", "16", "--mp", "off", "--interleave",
           "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stderr.count("bench fsdp: r=4 peft_lora peft_dora flashdora (mp off) on 2 ranks") == 1
    (path,) = tmp_path.glob("*_fsdp.json")
    result = json.loads(path.read_text())
    rows = {r["mode"]: r for r in result["records"]}
    assert set(rows) == {"peft_lora", "peft_dora", "flashdora"} and all(len(r["times_ms"]) == 2 for r in rows.values())
    assert rows["flashdora"]["norms_per_step"] == 14 and rows["peft_dora"]["norms_per_step"] is None
    assert all(len(r["losses"]) == 3 for r in rows.values())
    # the same weights and batches: PEFT's DoRA and flashdora train alike, each on its own model
    assert max(abs(a - b) for a, b in zip(rows["peft_dora"]["losses"], rows["flashdora"]["losses"])) < 1e-4
    assert result["protocol"]["order"].startswith("interleaved")
    assert "| 4 | off | flashdora |" in path.with_suffix(".md").read_text().split("paired vs peft_lora")[1]


@posix
def test_bench_fsdp_row_timeout_stops_the_ranks_and_keeps_the_rows(tmp_path):
    """A launch that runs past ``--row-timeout`` is stopped with its ranks (torchrun starts them in sessions of their
    own: none may live on) and recorded as an error; the result files are there, and the exit status is 1."""
    import json
    import time

    out_dir = tmp_path / "out"
    cmd = ["-m", "flashdora.cli", "bench", "fsdp", "--preset", "tiny", "--device", "cpu", "--nproc", "2", "--ranks",
           "4", "--modes", "peft_lora", "--reps", "100000", "--warmup", "0", "--seq", "16",
           "--row-timeout", "10", "--out", str(out_dir)]  # fmt: skip
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "ran past --row-timeout 10 s and was stopped" in out.stderr
    (path,) = out_dir.glob("*_fsdp.json")
    rows = json.loads(path.read_text())["records"]
    assert [(r["mode"], r["error"]) for r in rows] == [("peft_lora", "timeout after 10 s")]
    assert "timeout after 10 s" in path.with_suffix(".md").read_text()

    def ranks_alive() -> list[str]:  # the workers' command lines carry their options, this test's reps among them
        alive = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                text = cmdline.read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "flashdora.tools.bench.fsdp" in text and '"reps": 100000' in text:
                alive.append(cmdline.parent.name)
        return alive

    if Path("/proc/self/cmdline").exists():
        deadline = time.monotonic() + 10
        while ranks_alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ranks_alive() == []


@posix
def test_bench_fsdp_meta_init_trains_as_peft(tmp_path):
    """``--meta`` (what a 70B shape needs): built on the meta device, sharded, each rank's shards filled with the
    same random values for every mode, a bfloat16 base with float32 adapters under autocast. The loss falls, and
    flashdora's curve is PEFT DoRA's; the PNG plots the curves."""
    import json

    cmd = ["-m", "flashdora.cli", "bench", "fsdp", "--preset", "tiny", "--device", "cpu", "--nproc", "2", "--ranks",
           "4", "--modes", "peft_dora", "flashdora", "--reps", "4", "--warmup", "0", "--seq", "32", "--meta",
           "--mp", "off", "--lr", "3e-3", "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    (path,) = tmp_path.glob("*_fsdp.json")
    rows = {r["mode"]: r for r in json.loads(path.read_text())["records"]}
    peft, flash = rows["peft_dora"]["losses"], rows["flashdora"]["losses"]
    assert len(peft) == len(flash) == 5 and all(math.isfinite(v) for v in peft + flash)
    assert peft[-1] < peft[0] - 1e-3  # it trains (the shards hold values, not to_empty's garbage)
    assert max(abs(a - b) for a, b in zip(peft, flash)) < 2e-2  # bf16 autocast on both
    assert rows["flashdora"]["norms_per_step"] == 14
    assert path.with_suffix(".png").is_file()


@posix
def test_trainer_under_torchrun_ddp_as_peft():
    """``examples/train_with_trainer.py`` under ``torchrun``: the Trainer's own DDP over two processes, dropout on;
    flashdora's loss is PEFT's, and each layer's norm is computed once per step."""

    def trainer(*extra: str) -> tuple[str, str]:
        out = _run(str(ROOT / "examples" / "train_with_trainer.py"), "--skip-trl", "--max-steps", "4", *extra)
        loss = re.search(r"^Trainer: mean training loss ([0-9.]+)$", out, re.M)
        assert loss, out
        return loss.group(1), out

    (flash, out), (peft, _) = trainer(), trainer("--no-flashdora")
    assert flash == peft
    assert "'norm:eager': 56" in out, out  # 4 steps x 14 layers


def _layer():
    torch.manual_seed(0)
    config = LoraConfig(r=4, use_dora=True, target_modules=["proj"], init_lora_weights=False)
    model = get_peft_model(_Net(), config)
    return model, model.base_model.model.proj


def _tensors(layer):
    return [layer.base_layer.weight, layer.lora_A.default.weight, layer.lora_B.default.weight,
            layer.lora_magnitude_vector.default.weight]  # fmt: skip


def test_shard_tags_key_a_refilled_parameter_by_its_shard():
    """What FSDP2 does to an unsharded parameter, in one process: its storage re-filled in place without moving its
    version counter (the same address: the case address-based keys miss). Tagged with its shard (as
    ``watch.shards`` does after each all-gather), the cache follows the shard: a write to the shard recomputes the
    norm (uncached until the next gather re-tags), re-gathers of unchanged shards keep it."""
    model, layer = _layer()
    peft, twin_layer = _layer()
    flashdora.enable(model)
    x = torch.randn(3, 16)
    shards = [t.detach().clone() for t in _tensors(layer)]

    def gather(values=None):  # FSDP2's all-gather: copy the shards in, the version counter kept
        for p, shard, twin in zip(_tensors(layer), shards, _tensors(twin_layer)):
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
                p.copy_(shard)
            with torch.no_grad():
                twin.copy_(shard)
            p._flashdora_shard = (shard, shard, shard._version, shard._version)  # (DTensor, local): one here

    def norms():
        return flashdora.stats().get("norm:eager", 0)

    gather()
    flashdora.reset_stats()
    with torch.no_grad():
        torch.testing.assert_close(model(x), peft(x))
        gather()  # the same shards again (a checkpoint's recomputation): cached
        torch.testing.assert_close(model(x), peft(x))
        assert norms() == 1
        shards[2].mul_(1.5)  # an optimizer step or an edit of the shard, before FSDP2 gathers it
        torch.testing.assert_close(model(x), peft(x))  # the old gathered values: computed, not cached
        gather()
        torch.testing.assert_close(model(x), peft(x))
        torch.testing.assert_close(model(x), peft(x))
        assert norms() == 3
    for p in _tensors(layer):
        del p._flashdora_shard
