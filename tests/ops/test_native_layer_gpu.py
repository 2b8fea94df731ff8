"""The whole layer in one C++ call (``native/csrc/layer.cpp``, route ``native/native/native``) on the GPU: the real
call gives the split path's values, from a fresh model, with and without checkpointing, reads the forward's casts
in the backward as the Triton path's backward computes them, matches PEFT's DoRA, and leaves every other call to the
split path. Its CPU tests (the node's ATen twin) are in test_native_layer.py.
"""

import copy

import pytest
import torch
from torch import nn

import flashdora
from flashdora import dispatch, native
from flashdora.peft import variant


def _model(bias=False):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 384, bias=bias), nn.GELU(), nn.Linear(384, 256, bias=bias))
    net = net.to(device="cuda", dtype=torch.bfloat16)
    cfg = LoraConfig(r=16, lora_alpha=24, use_dora=True, target_modules=["0", "2"], init_lora_weights=False)
    return get_peft_model(net, cfg)


def _run(model, x, dy, checkpoint=None):
    from torch.utils.checkpoint import checkpoint as ckpt

    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = model(x) if checkpoint is None else ckpt(model, x, use_reentrant=checkpoint)
    y.backward(dy)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return y.detach(), x.grad.clone() if x.grad is not None else None, grads


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", [None, False, True], ids=["plain", "non-reentrant", "reentrant"])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_layer_call_gives_the_split_paths_values(ext, monkeypatch, bias, checkpoint):
    """A fresh model's first training calls (plans primed on the way) take ``native/native/native`` and give the
    split path's output and LoRA gradients bit for bit, and its input gradient within one rounding (``dx``'s two
    products added inside one GEMM); under checkpointing the recomputation takes the same route."""
    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    monkeypatch.setattr(native.build, "_module", ext)
    model = flashdora.enable(_model(bias))
    x = torch.randn(4, 33, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4, 33, 256, device="cuda", dtype=torch.bfloat16)
    runs = {}
    for fuse in (True, False):
        monkeypatch.setattr(variant, "FUSE", fuse)
        flashdora.reset_stats()
        x.grad = None
        runs[fuse] = _run(model, x, dy, checkpoint)
        layers = [m for m in model.modules() if hasattr(m, "lora_variant")]
        want = ("native", "native", "native" if fuse else "module")
        assert all(dispatch.last_route(m, "default")[:3] == want for m in layers), fuse
        assert (flashdora.stats().get("native_layer", 0) > 0) == fuse
    (y, dx, grads), (y_split, dx_split, grads_split) = runs[True], runs[False]
    assert not y.isnan().any()
    torch.testing.assert_close(y, y_split, rtol=0, atol=0)
    assert grads.keys() == grads_split.keys() and len(grads) == 6
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_split[name], rtol=0, atol=0, msg=name)
    assert (dx - dx_split).float().norm() <= 4e-3 * dx_split.float().norm()


@pytest.mark.gpu
def test_gpu_both_nodes_read_the_forwards_casts(ext, monkeypatch):
    """Where the forward casts lora_B to bf16 first (8192 tokens on a float32 [4096, 64] lora_B: ``cast_b_first``),
    the compose's node (``native/native/module``) and the layer's (``native/native/native``) read the forward's casts
    of lora_B (and the layer's of lora_A) in the backward: output and LoRA gradients are the Triton path's (native
    off: cast again in the backward) bit for bit, x's too for the compose's node and within one rounding for the
    layer's (its two products added inside one GEMM)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 4096, bias=False)).to(device="cuda", dtype=torch.bfloat16)
    cfg = LoraConfig(r=64, lora_alpha=32, use_dora=True, target_modules=["0"], init_lora_weights=False)
    model = flashdora.enable(get_peft_model(net, cfg))
    layer = model.base_model.model[0]
    assert layer.lora_B["default"].weight.dtype == torch.float32
    x = torch.randn(1, 8192, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, 8192, 4096, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(native.build, "_module", ext)
    runs = {}
    for mode, want in (("triton", ("triton", "triton", "module")), ("split", ("native", "native", "module")),
                       ("layer", ("native", "native", "native"))):  # fmt: skip
        monkeypatch.setenv("FLASHDORA_NATIVE", "0" if mode == "triton" else "1")
        monkeypatch.setattr(variant, "FUSE", mode == "layer")
        for _ in range(2):  # (the first call of a route files its plans)
            x.grad = None
            torch.full((256 * 2**20,), float("nan"), device="cuda")  # freed at once: the next allocations reuse NaNs
            runs[mode] = _run(model, x, dy)
        assert dispatch.last_route(layer, "default")[:3] == want, mode
    y, dx, grads = runs["triton"]
    assert not y.isnan().any() and len(grads) == 3
    for mode in ("split", "layer"):
        y_m, dx_m, grads_m = runs[mode]
        torch.testing.assert_close(y_m, y, rtol=0, atol=0, msg=mode)
        for name, g in grads.items():
            torch.testing.assert_close(grads_m[name], g, rtol=0, atol=0, msg=f"{mode} {name}")
    torch.testing.assert_close(runs["split"][1], dx, rtol=0, atol=0)
    assert (runs["layer"][1] - dx).float().norm() <= 4e-3 * dx.float().norm()


@pytest.mark.gpu
def test_gpu_layer_call_matches_peft_in_inference_and_training(ext, monkeypatch):
    """Against PEFT's DoRA from identical weights: inference (no grad: no node) and a training step."""
    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    monkeypatch.setattr(native.build, "_module", ext)
    peft_model = _model(bias=True)
    model = flashdora.enable(copy.deepcopy(peft_model))
    x = torch.randn(2, 50, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        y, want = model(x), peft_model(x)
    assert dispatch.last_route(model.base_model.model[0], "default")[2] == "native"
    assert (y.float() - want.float()).norm() <= 1e-2 * want.float().norm()
    dy = torch.randn_like(y)
    (y, _, grads), (want, _, want_grads) = _run(model, x, dy), _run(peft_model, x, dy)
    assert (y.float() - want.float()).norm() <= 1e-2 * want.float().norm()
    for name, g in want_grads.items():
        assert (grads[name] - g).norm() <= 3e-2 * g.norm(), name


@pytest.mark.gpu
def test_gpu_layer_call_leaves_the_base_to_its_hooks_and_other_dtypes(ext, monkeypatch):
    """A forward hook on the base layer runs (the base is called: ``native/native/module``); an input in another
    dtype than the weight's takes the split path; an in-place change of the base weight before the backward fails it,
    naming the weight; dropout in training takes the split path, and in eval mode the layer call."""
    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    monkeypatch.setattr(native.build, "_module", ext)
    model = flashdora.enable(_model())
    layer = model.base_model.model[0]
    x = torch.randn(3, 17, 256, device="cuda", dtype=torch.bfloat16)
    seen = []
    handle = layer.base_layer.register_forward_hook(lambda *args: seen.append(1))
    _run(model, x, torch.randn(3, 17, 256, device="cuda", dtype=torch.bfloat16))
    handle.remove()
    assert seen == [1] and dispatch.last_route(layer, "default")[:3] == ("native", "native", "module")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(x.float())
    assert dispatch.last_route(layer, "default")[2] == "module"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = model(x.clone().requires_grad_())  # (dx reads the weight again: its version is checked)
    assert dispatch.last_route(layer, "default")[2] == "native"
    with torch.no_grad():
        layer.base_layer.weight.add_(0.0)
    with pytest.raises(RuntimeError, match="base layer's weight was modified by an inplace operation"):
        y.float().sum().backward()
    layer.lora_dropout["default"] = nn.Dropout(0.1)  # dropout in training: the split path; in eval, none to apply
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model.train()(x)
        assert dispatch.last_route(layer, "default")[2] == "module"
        model.eval()(x)
        assert dispatch.last_route(layer, "default")[2] == "native"


_FIRST_BACKWARD = """
import torch
from peft import LoraConfig, get_peft_model
import flashdora
net = torch.nn.Sequential(torch.nn.Linear(256, 384)).to("cuda", torch.bfloat16)
cfg = LoraConfig(r=8, lora_alpha=8, use_dora=True, target_modules=["0"], init_lora_weights=False)
model = flashdora.enable(get_peft_model(net, cfg))
x = torch.randn(2, 16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
with torch.autocast("cuda", dtype=torch.bfloat16):
    y = model(x)
assert y.grad_fn.name() == "FlashDoraLayerBackward", y.grad_fn
y.backward(torch.randn_like(y))
torch.cuda.synchronize()
assert x.grad is not None and not x.grad.isnan().any()
print("ok")
"""


@pytest.mark.gpu
def test_gpu_a_fresh_process_whose_first_backward_node_is_the_layers(ext):
    """In a fresh process, a backward that starts at a layer call's output runs the C++ node first on the autograd
    engine's device thread, before any CUDA runtime call there has made the device's context current: the node's
    launch makes it current (it failed with CUresult 201 before)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", _FIRST_BACKWARD]
    done = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
