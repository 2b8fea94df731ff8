"""The whole layer in one C++ call (``native/csrc/layer.cpp``, route ``native/native/native``): a plain ``nn.Linear``
base's matmul, the LoRA A matmul and the compose, and one autograd node for the backward.

On the CPU the node's twin (``attach_layer_eager``: the compose kernel's math in ATen) checks the wiring and the
backward's algebra (``dx = g dy W + s g dy B A``, ``dA``, ``dB``, ``dm``) against autograd through the split path;
``plain_base`` says when a base may go uncalled. The GPU tests are in test_native_layer_gpu.py.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import flashdora
from flashdora import dispatch
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


def _eager_node(ext, x, w, b, lora_A, lora_B, mag, scales, s, a_cast=None, b_cast=None):
    """y with the layer's node (ATen twin) hung on it; the matmuls in x's dtype (lora_A cast to it, as the layer call
    casts float32 adapters under autocast). ``a_cast``, ``b_cast``: the forward's casts handed to the node."""
    with torch.no_grad():
        result, a = F.linear(x, w, b), F.linear(x, lora_A.to(x.dtype))
        y, inner = C._fwd(result, a, None, b, lora_B, scales, s, x.dtype, True, False)
    ext.attach_layer_eager(y, x, w, lora_A, lora_B, mag, a, inner, scales, s, a_cast=a_cast, b=b_cast)
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
    y = _eager_node(ext, x, w, b, lora_A, lora_B, mag, scales, 0.5)
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
        y = _eager_node(ext, x, w, b, lora_A, lora_B, mag, scales, 0.5, a_cast, b_cast)
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
        return _eager_node(ext, x, w, b, lora_A, lora_B, mag, scales, 0.5, a_cast, b_cast)

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
