"""DeepSpeed: ZeRO-3 partitions every parameter and gathers it in module hooks; flashdora reads the adapter and base
weights in the engine's forward, where DeepSpeed gathers them and registers them with the LoRA layer (for its backward
and recomputation too), and runs its own path, ``||W||^2`` keyed by the ZeRO partition; a call that finds a parameter
partitioned runs PEFT's own forward (``peft_fallback:deepspeed_zero3``). Under ZeRO-2 it runs its own path. Two ranks
on the CPU (gloo, DeepSpeed's CPU accelerator; ``tests/ds_worker.py``), and the fallback in one process on parameters
tagged as DeepSpeed tags them."""

import importlib.util
import os
import subprocess
import sys
import warnings
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
CASES = (
    "zero3",
    "zero3-after",
    "zero3-accelerate",
    "zero3-release",
    "zero3-reentrant",
    "zero2",
    "zero3-freeze-after",
    "zero2-freeze-after",
    "zero3-trainer",
)


def _worker(*args: str, env: dict[str, str] | None = None) -> str:
    cmd = [*TORCHRUN, str(ROOT / "tests" / "ds_worker.py"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@needs_deepspeed
@pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo")
def test_deepspeed_trains_like_peft_on_two_cpu_ranks():
    """Two ranks on the CPU, 3 AdamW steps, fp32, gradient checkpointing on: under ZeRO-3 (``deepspeed.initialize``
    with flashdora enabled before or after it, with every parameter released after each use and re-gathered, with
    reentrant checkpointing, accelerate's ``DeepSpeedPlugin(zero_stage=3)``, and the Trainer with the model built
    under ``deepspeed.zero.Init``) the parameters are partitioned at rest, every DoRA call runs flashdora's own path
    (no fallback, named by ``report()``) with one ``||W||^2`` per frozen base in the run, and losses and adapter
    weights equal PEFT's under the same config and in one process; under ZeRO-2 flashdora's own path, one norm per
    layer per step and one ``||W||^2`` per frozen base, with the same results. (The checks are the worker's.)"""
    out = _worker(env={"DS_ACCELERATOR": "cpu"})
    assert all(f"OK {case}\n" in out for case in CASES), out


@pytest.mark.gpu2
@needs_deepspeed
def test_deepspeed_trains_like_peft_on_two_gpus():
    """The same on two GPUs (NCCL): the Triton path under ZeRO-3 and ZeRO-2."""
    out = _worker("--device", "cuda")
    assert all(f"OK {case}\n" in out for case in CASES), out


class _Available:  # DeepSpeed's ``ZeroParamStatus.AVAILABLE``, as ``_gathered`` reads it (by name)
    name = "AVAILABLE"


def _tagged_llama(gathered: bool):
    """``(model, ids, PEFT's logits, tagged)``: the tiny Llama enabled after PEFT's logits were taken, each base weight
    of its DoRA layers tagged as DeepSpeed ZeRO-3 tags a parameter (``ds_id``; ``gathered``: also ``ds_status``
    AVAILABLE and ``ds_numel``, as while gathered)."""
    model = llama(dropout=0.0)
    ids = make_ids(model.config.vocab_size)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    flashdora.enable(model)
    tagged = [p for n, p in model.named_parameters() if "base_layer.weight" in n]
    for i, p in enumerate(tagged):
        p.ds_id = i
        if gathered:
            p.ds_status, p.ds_numel = _Available(), p.numel()
    return model, ids, want, tagged


def test_zero3_parameters_run_peft_forward():
    """A layer whose parameters carry DeepSpeed's ZeRO-3 tag (``ds_id``, set on every parameter it partitions) but
    not its ``ds_status`` AVAILABLE runs PEFT's forward with its own counted reason, even with no hook in sight:
    outside its gathers such a parameter is empty. (Tagged by hand here, whole: the same output as PEFT's own.)"""
    model, ids, want, tagged = _tagged_llama(gathered=False)
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


@pytest.mark.parametrize("tested", [True, False], ids=["tested", "untested"])
def test_gathered_zero3_parameters_take_flashdoras_route_only_on_a_tested_deepspeed(monkeypatch, tested):
    """Parameters tagged as DeepSpeed tags them while gathered (``ds_id``, ``ds_status`` AVAILABLE, whole) run
    flashdora's route on a DeepSpeed the tests cover, and PEFT's forward (``peft_fallback:deepspeed_zero3``) on any
    other, or with ``private_apis`` off: telling ZeRO-3's module hooks from a user's reads DeepSpeed's private
    closure names (``config.deepspeed_tested``). The output is PEFT's either way."""
    from flashdora import config

    monkeypatch.setattr(config, "_DEEPSPEED_TESTED", [tested])
    model, ids, want, tagged = _tagged_llama(gathered=True)
    flashdora.reset_stats()
    backend._warned.discard("fallback:deepspeed_zero3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = model(input_ids=ids).logits
    assert rel_err(got, want) < 1e-5
    fallbacks = {k: v for k, v in flashdora.stats().items() if k.startswith("peft_fallback")}
    assert fallbacks == ({} if tested else {"peft_fallback:deepspeed_zero3": len(tagged)})
    assert any("deepspeed_zero3" in str(w.message) for w in caught) is not tested
    if tested:
        monkeypatch.setenv("FLASHDORA_PRIVATE_APIS", "0")
        config.reload()
        flashdora.reset_stats()
        with torch.no_grad():
            model(input_ids=ids)
        assert flashdora.stats().get("peft_fallback:deepspeed_zero3") == len(tagged)


def test_zero3_conv1d_base_runs_peft_forward(monkeypatch):
    """A gathered ZeRO-3 ``Conv1D`` base (GPT-2's, ``fan_in_fan_out``) runs PEFT's forward
    (``peft_fallback:deepspeed_zero3:fan_in_fan_out``): flashdora's ``weight.T`` view would hold the gathered weight
    until the backward, where DeepSpeed frees it after the forward."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from flashdora import config

    monkeypatch.setattr(config, "_DEEPSPEED_TESTED", [True])
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    lora = LoraConfig(r=4, use_dora=True, init_lora_weights=False, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(GPT2LMHeadModel(cfg), lora).eval()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    flashdora.enable(model)
    (weight,) = [p for n, p in model.named_parameters() if "base_layer.weight" in n]
    weight.ds_id, weight.ds_status, weight.ds_numel = 0, _Available(), weight.numel()
    flashdora.reset_stats()
    backend._warned.discard("fallback:deepspeed_zero3:fan_in_fan_out")
    with pytest.warns(UserWarning, match="fan_in_fan_out"), torch.no_grad():
        got = model(input_ids=ids).logits
    assert rel_err(got, want) < 1e-5
    assert flashdora.stats() == {"peft_fallback:deepspeed_zero3:fan_in_fan_out": 1}


def test_zero3_layers_take_the_cpp_route_like_any_other(monkeypatch):
    """Where the C++ route runs (``compose_impl`` says ``native``), a gathered ZeRO-3 layer takes it too: plans are
    filed before a call runs (prime, then run), so a checkpoint's recomputation, which gathers the weight again and
    computes its norm anew, takes its forward's route. Checked on the route each layer records."""
    from flashdora import config, dispatch
    from flashdora.ops import compose

    monkeypatch.setattr(config, "_DEEPSPEED_TESTED", [True])
    monkeypatch.setattr(dispatch, "compose_impl", lambda *args: "native")
    monkeypatch.setattr(dispatch, "norm_impl", lambda *args: "eager")  # (a CPU test: the compose's route is checked)
    monkeypatch.setattr(dispatch, "SEEN", set())  # (this made-up route stays out of the session's route check)
    monkeypatch.setattr(dispatch, "_ROUTES", {})
    model, ids, _, tagged = _tagged_llama(gathered=True)
    ran = []
    monkeypatch.setattr(compose, "compose_eager", lambda *args: ran.append(args[-1]) or args[0])  # (impl: last)
    with torch.no_grad():
        model(input_ids=ids)
    routes = {r.compose for m in model.modules() for r in m.__dict__.get("_flashdora_routes", {}).values()}
    assert routes == {"native"} and set(ran) == {"native"} and len(ran) == len(tagged), (routes, ran)


def _deepspeeds_hook(module, args):  # named below as DeepSpeed ZeRO-3's own module hooks are
    return None


_deepspeeds_hook.__module__ = "deepspeed.runtime.zero.parameter_offload"
_deepspeeds_hook.__qualname__ = "DeepSpeedZeRoOffload._register_deepspeed_module.<locals>._pre_forward_module_hook"


def test_zero3_hooks_are_not_taken_for_deepspeeds_while_compiling(monkeypatch):
    """``zero3_hooks_only`` recognises ZeRO-3's module hooks (by their names, on a tested DeepSpeed) in eager calls
    only: while compiling, DeepSpeed gathers nothing a layer reads, and ``reason`` cannot look at the parameters, so
    the hooks count as a user's (PEFT's forward calls the modules)."""
    from flashdora import config
    from flashdora.peft.support import hooked, zero3_hooks_only

    monkeypatch.setattr(config, "_DEEPSPEED_TESTED", [True])
    module = torch.nn.Linear(4, 4)
    module.register_forward_pre_hook(_deepspeeds_hook)
    assert zero3_hooks_only(module) and hooked(module) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not zero3_hooks_only(module) and hooked(module) == "Linear"
