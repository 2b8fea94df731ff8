"""The whole layer in one C++ call (``native/csrc/layer.cpp``, route ``native/native/native``): a plain ``nn.Linear``
base's matmul, the LoRA A matmul and the compose, and one autograd node for the backward.

On the CPU the node's twin (``attach_layer_eager``: the compose kernel's math in ATen) checks the wiring and the
backward's algebra (``dx = g dy W + s g dy B A``, ``dA``, ``dB``, ``dm``) against autograd through the split path;
``plain_base`` says when a base may go uncalled. On the GPU the real call must give the split path's values, from a
fresh model, with and without checkpointing, and leave every other call to the split path.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import flashdora
from flashdora import dispatch, native
from flashdora.ops import compose as C
from flashdora.ops.norm import fresh
from flashdora.peft import variant
from flashdora.peft.support import plain_base


def _inputs(dtype, t=7, d_in=24, d_out=40, r=5, bias=True, device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(2, t, d_in, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(d_out, d_in, dtype=dtype, device=device) / d_in**0.5
    b = torch.randn(d_out, dtype=dtype, device=device) if bias else None
    lora_A = (torch.randn(r, d_in, dtype=dtype, device=device) / d_in**0.5).requires_grad_()
    lora_B = torch.randn(d_out, r, dtype=dtype, device=device).requires_grad_()
    mag = (torch.rand(d_out, dtype=dtype, device=device) + 0.5).requires_grad_()
    return x, w, b, lora_A, lora_B, mag


def _eager_node(ext, x, w, b, lora_A, lora_B, mag, scales, s):
    """y with the layer's node (ATen twin) hung on it."""
    with torch.no_grad():
        result, a = F.linear(x, w, b), F.linear(x, lora_A)
        y, inner = C._fwd(result, a, None, b, lora_B, scales, s, x.dtype, True, False)
    ext.attach_layer_eager(y, x, w, lora_A, lora_B, mag, a, inner, scales, s)
    return y


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("s", [1.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_node_gives_the_split_paths_gradients(ext, dtype, s, bias):
    """Every gradient (x, lora_A, lora_B, magnitude) as autograd gives it through the split path (the base's
    F.linear, the A matmul, ``ComposeFunction``); ``dx``'s two products are added inside one GEMM, so float32 is
    close, not equal."""
    x, w, b, lora_A, lora_B, mag = _inputs(dtype, bias=bias)
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), s, "eager")[1]
    dy = torch.randn(2, 7, 40, dtype=dtype)
    y = _eager_node(ext, x, w, b, lora_A, lora_B, mag, scales, s)
    assert y.grad_fn.name() == "FlashDoraLayerBackward"
    got = torch.autograd.grad(y, (x, lora_A, lora_B, mag), dy)
    result, a = F.linear(x, w, b), F.linear(x, lora_A)
    ref_y = C.ComposeFunction.apply(result, a, None, b, lora_B, mag, scales, s, dtype, False)
    want = torch.autograd.grad(ref_y, (x, lora_A, lora_B, mag), dy)
    for name, g, ref in zip(("x", "lora_A", "lora_B", "magnitude"), got, want, strict=True):
        assert g.dtype == ref.dtype and g.shape == ref.shape, name
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(g, ref, rtol=tol, atol=tol, msg=name)


def test_cpu_node_with_16_bit_matmuls_and_float32_adapters(ext):
    """The autocast case's dtypes (bf16 x and weight, float32 adapters, bf16 matmuls): lora_A's and lora_B's gradients
    come back in float32 (autograd casts the node's bf16 ones) and equal the split path's (the same GEMMs on the same
    operands); x's within one rounding (its two products added inside one GEMM instead of after)."""
    x, w, b, _, _, _ = _inputs(torch.bfloat16)
    _, _, _, lora_A, lora_B, mag = _inputs(torch.float32)
    scales = fresh(w.float(), lora_A.detach(), lora_B.detach(), mag.detach(), 0.5, "eager")[1]
    dy = torch.randn(2, 7, 40, dtype=torch.bfloat16)
    with torch.no_grad():
        result, a = F.linear(x, w, b), F.linear(x, lora_A.to(torch.bfloat16))
        y, inner = C._fwd(result, a, None, b, lora_B, scales, 0.5, torch.bfloat16, True, False)
    ext.attach_layer_eager(y, x, w, lora_A, lora_B, mag, a, inner, scales, 0.5)
    got = torch.autograd.grad(y, (x, lora_A, lora_B, mag), dy)
    result, a = F.linear(x, w, b), F.linear(x, lora_A.to(torch.bfloat16))
    ref = C.ComposeFunction.apply(result, a, None, b, lora_B, mag, scales, 0.5, torch.bfloat16, False)
    want = torch.autograd.grad(ref, (x, lora_A, lora_B, mag), dy)
    for name, g, r in zip(("x", "lora_A", "lora_B", "magnitude"), got, want, strict=True):
        assert g.dtype == r.dtype, name
    assert got[1].dtype == got[2].dtype == torch.float32
    for name, g, r in zip(("lora_A", "lora_B", "magnitude"), got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0, msg=name)
    assert (got[0] - want[0]).float().norm() <= 1e-2 * want[0].float().norm()
    assert got[0].abs().sum() > 0


@pytest.mark.parametrize(("r", "kept"), [(33, True), (32, False), (36, False)], ids=["kept", "small-r", "few-tokens"])
def test_cpu_node_reads_the_adapters_as_the_forward_cast_them(ext, r, kept):
    """bf16 matmuls on float32 adapters: the backward's ``da A`` and ``s gdy B`` read lora_A and lora_B as the
    forward cast them above rank 32 where they add at most a quarter to what the node saves (``keep_casts``:
    4 r <= T, 140 tokens here), and cast them again otherwise. Handed the true casts, every gradient is the one
    without them, bit for bit; handed wrong ones (2 A and 2 B, exactly), x's gradient (both) and lora_A's (B) move
    exactly where they are kept; lora_A's version is still checked."""
    x, w, b, _, _, _ = _inputs(torch.bfloat16, t=70, r=r)
    _, _, _, lora_A, lora_B, mag = _inputs(torch.float32, t=70, r=r)
    scales = fresh(w.float(), lora_A.detach(), lora_B.detach(), mag.detach(), 0.5, "eager")[1]
    dy = torch.randn(2, 70, 40, dtype=torch.bfloat16)
    bf16 = torch.bfloat16

    def grads(a_cast=None, b_cast=None, bump=False):
        with torch.no_grad():
            result, a = F.linear(x, w, b), F.linear(x, lora_A.to(bf16))
            y, inner = C._fwd(result, a, None, b, lora_B, scales, 0.5, bf16, True, False)
        ext.attach_layer_eager(y, x, w, lora_A, lora_B, mag, a, inner, scales, 0.5, a_cast=a_cast, b=b_cast)
        if bump:
            with torch.no_grad():
                lora_A.add_(0.0)
        return torch.autograd.grad(y, (x, lora_A, lora_B, mag), dy)

    plain = grads()
    true = grads(lora_A.detach().to(bf16), lora_B.detach().to(bf16))
    for got, want in zip(true, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    wrong = grads((2 * lora_A.detach()).to(bf16), (2 * lora_B.detach()).to(bf16))
    for name, got, want in zip(("x", "lora_A", "lora_B", "magnitude"), wrong, plain, strict=True):
        moved = name in ("x", "lora_A") and kept
        assert torch.equal(got, want) != moved, name
    with pytest.raises(RuntimeError, match="lora_A was modified by an inplace operation"):
        grads(lora_A.detach().to(bf16), lora_B.detach().to(bf16), bump=True)


def test_cpu_node_saves_the_casts_as_checkpointing_sees_them(ext):
    """The kept casts are saved tensors, not members: under non-reentrant checkpointing the forward keeps none of
    them (they would otherwise live from every layer's forward to its backward), and the backward gets them from the
    recomputation, with the gradients of the call without checkpointing."""
    import weakref

    from torch.utils.checkpoint import checkpoint

    x, w, b, _, _, _ = _inputs(torch.bfloat16, t=70, r=33)
    _, _, _, lora_A, lora_B, mag = _inputs(torch.float32, t=70, r=33)
    scales = fresh(w.float(), lora_A.detach(), lora_B.detach(), mag.detach(), 0.5, "eager")[1]
    dy = torch.randn(2, 70, 40, dtype=torch.bfloat16)
    casts = []

    def layer(x):
        a_cast, b_cast = lora_A.detach().to(torch.bfloat16), lora_B.detach().to(torch.bfloat16)
        casts.extend((weakref.ref(a_cast), weakref.ref(b_cast)))
        with torch.no_grad():
            result, a = F.linear(x, w, b), F.linear(x, a_cast)
            y, inner = C._fwd(result, a, None, b, lora_B, scales, 0.5, torch.bfloat16, True, False)
        ext.attach_layer_eager(y, x, w, lora_A, lora_B, mag, a, inner, scales, 0.5, a_cast=a_cast, b=b_cast)
        return y

    y = layer(x)
    assert all(ref() is not None for ref in casts)  # held by the graph until its backward
    want = torch.autograd.grad(y, (x, lora_A, lora_B, mag), dy)
    assert all(ref() is None for ref in casts)  # (and freed by it)
    casts.clear()
    y = checkpoint(layer, x, use_reentrant=False)
    assert len(casts) == 2 and all(ref() is None for ref in casts)
    got = torch.autograd.grad(y, (x, lora_A, lora_B, mag), dy)
    assert len(casts) == 4  # (recomputed)
    for g, ref in zip(got, want, strict=True):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_cpu_node_skips_what_needs_no_gradient_and_checks_versions(ext):
    """An input that needs no gradient gets none (a frozen x, a frozen lora_A); the base weight, lora_A and lora_B
    modified in place between the forward and the backward fail the backward with the tensor's name, as autograd's
    saved tensors would; a second backward without ``retain_graph`` is refused."""
    x, w, b, lora_A, lora_B, mag = _inputs(torch.float64)
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), 0.5, "eager")[1]
    frozen_x, frozen_A = x.detach(), lora_A.detach()
    y = _eager_node(ext, frozen_x, w, b, frozen_A, lora_B, mag, scales, 0.5)
    y.sum().backward()
    assert lora_B.grad is not None and mag.grad is not None and x.grad is None and lora_A.grad is None
    for tensor, name in ((w, "base layer's weight"), (lora_A, "lora_A"), (lora_B, "lora_B")):
        y = _eager_node(ext, x, w, b, lora_A, lora_B, mag, scales, 0.5)
        with torch.no_grad():
            tensor.add_(0.0)  # (a version bump, the values unchanged)
        with pytest.raises(RuntimeError, match=f"{name} was modified by an inplace operation"):
            y.sum().backward()
    y = _eager_node(ext, x, w, b, lora_A, lora_B, mag, scales, 0.5)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.sum().backward()


def test_plain_base_says_when_a_base_layer_may_go_uncalled():
    """A plain ``nn.Linear`` with frozen plain parameters, no hooks and no torch function mode, on a plain tensor:
    yes. Each of the things a caller could see missing: no."""
    base = nn.Linear(8, 4).requires_grad_(False)
    x = torch.randn(3, 8)
    assert plain_base(base, x)
    assert not plain_base(base, nn.Parameter(x))
    handle = base.register_forward_hook(lambda *args: None)
    assert not plain_base(base, x)
    handle.remove()
    handle = base.register_forward_pre_hook(lambda *args: None)
    assert not plain_base(base, x)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    assert not plain_base(base, x)
    handle.remove()
    with TorchFunctionMode():
        assert not plain_base(base, x)
    base.bias.requires_grad_(True)
    assert not plain_base(base, x)
    base.bias.requires_grad_(False)
    base.weight.requires_grad_(True)
    assert not plain_base(base, x)
    base.weight.requires_grad_(False)
    assert not plain_base(type("Sub", (nn.Linear,), {})(8, 4).requires_grad_(False), x)
    torch.nn.utils.parametrize.register_parametrization(base, "weight", nn.Identity())
    assert not plain_base(base, x)
    assert plain_base(nn.Linear(8, 4, bias=False).requires_grad_(False), x)


def test_a_process_group_keeps_the_first_call_off_the_layer_call(monkeypatch):
    """Once a process group is up, flashdora's FSDP2 watch (a process-wide hook) keeps layers off the layer call; it
    is installed before the layer call's check, so a process's first call decides as every later one does (a
    checkpoint's recomputation on the other path would save other tensors)."""
    from peft import LoraConfig, get_peft_model

    from flashdora.peft import watch

    net = nn.Sequential(nn.Linear(16, 8))
    model = flashdora.enable(get_peft_model(net, LoraConfig(r=2, use_dora=True, target_modules=["0"])))
    layer, x = model.base_model.model[0], torch.randn(3, 16)
    assert plain_base(layer.base_layer, x)
    asked = []
    monkeypatch.setattr(dispatch, "fused_route", lambda *args: asked.append(1))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(watch, "fsdp_hook", None)
    try:
        assert variant.fused_forward(layer, "default", x, layer.base_layer) is None
        assert watch.fsdp_hook is not None and asked == []
        assert not plain_base(layer.base_layer, x)
    finally:
        if watch.fsdp_hook is not None:
            watch.fsdp_hook.remove()


# ---- On the GPU ----


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
