"""``flashdora.native``: the compose's backward as a C++ autograd node, against the Python ``ComposeFunction``.

On the CPU the node's ATen twin (``attach_eager``) checks the wiring: edges, saved tensors, dtype casts by the engine,
the checks; on the GPU the real node (the compiled Triton kernel launched from C++) must give the Python path's bits.
"""

import pytest
import torch
import torch.nn.functional as F

from flashdora import native
from flashdora.ops import compose as C
from flashdora.ops.norm import fresh
from tests.helpers import backward_order


def _layer(device, dtype, adapter_dtype, t=7, d_in=24, d_out=40, r=5):
    x = torch.randn(2, t, d_in, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(d_out, d_in, device=device, dtype=dtype) / d_in**0.5
    lora_A = torch.randn(r, d_in, device=device, dtype=adapter_dtype, requires_grad=True)
    lora_B = torch.randn(d_out, r, device=device, dtype=adapter_dtype, requires_grad=True)
    mag = (torch.rand(d_out, device=device, dtype=adapter_dtype) + 0.5).requires_grad_()
    return x, w, lora_A, lora_B, mag


def _eager_node(ext, x, w, lora_A, lora_B, mag, scales, s, dtype, b=None):
    """``y`` of the compose on ``x``'s layer (``lora_A`` cast to ``dtype``) with the node's ATen twin hung on it;
    ``b``: lora_B as the forward kernel read it (``attach_eager``'s)."""
    result, a = F.linear(x, w), F.linear(x, lora_A.to(dtype))
    with torch.no_grad():
        y, inner = C._fwd(result, a, None, None, lora_B, scales, s, dtype, True, False)
    ext.attach_eager(y, result, a, lora_B, mag, inner, scales, s, b=b)
    return y


@pytest.mark.parametrize("s", [0.5, 0.3])
@pytest.mark.parametrize("dropout", [False, True, "no-grad"], ids=["plain", "lx_base", "lx_base-no-grad"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_cpu_node_matches_python_function(ext, dtype, dropout, s):
    """The node's wiring, also with dropout's exact form (``lx_base = lx W^T``, a fifth input whose gradient is
    ``(g - 1) dy``; ``d_result = dy``), with and without a gradient to ``lx_base``: every gradient the same as
    ``ComposeFunction``'s. ``s = 0.3`` tells ``(dy s) g`` from ``s (g dy)`` (a power of two would not)."""
    adapter = torch.float64 if dtype == torch.float64 else torch.float32
    x, w, lora_A, lora_B, mag = _layer("cpu", dtype, adapter)
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), s, "eager")[1]
    dy = torch.randn(2, 7, 40, dtype=dtype)
    mask = (torch.rand_like(x) > 0.3).to(dtype) / 0.7
    grads = []
    for use_node in (False, True):
        result = F.linear(x, w)
        lx = x * mask if dropout else x
        lx_base = F.linear(lx.detach() if dropout == "no-grad" else lx, w) if dropout else None
        a = F.linear(lx, lora_A.to(dtype))
        if use_node:
            with torch.no_grad():
                y, inner = C._fwd(result, a, lx_base, None, lora_B, scales, s, dtype, True, False)
            ext.attach_eager(y, result, a, lora_B, mag, inner, scales, s, lx_base=lx_base)
            assert y.grad_fn.name() == "FlashDoraComposeBackward"
        else:
            y = C.ComposeFunction.apply(result, a, lx_base, None, lora_B, mag, scales, s, dtype, False)
        grads.append((y.detach(), *torch.autograd.grad(y, (x, lora_A, lora_B, mag), dy)))
    for want, got in zip(*grads):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same math, op for op


@pytest.mark.parametrize(("r", "kept"), [(33, True), (32, False), (36, False)], ids=["kept", "small-r", "few-tokens"])
def test_cpu_node_reads_lora_B_as_the_forward_cast_it(ext, r, kept):
    """bf16 matmuls on a float32 lora_B: the backward's ``s gdy B`` reads lora_B as the forward kernel read it (cast
    to bf16 first) above rank 32 where that adds at most a quarter to what the node saves (``keep_casts``: 4 r <= T,
    140 tokens here), and casts lora_B again otherwise. Handed the true cast, every gradient is the one without it,
    bit for bit; handed a wrong one (2 B, exactly), the LoRA A side's gradients move exactly where it is kept, and
    lora_B's own version is still checked."""
    x, w, lora_A, lora_B, mag = _layer("cpu", torch.bfloat16, torch.float32, t=70, r=r)
    scales = fresh(w.float(), lora_A.detach(), lora_B.detach(), mag.detach(), 0.5, "eager")[1]
    dy = torch.randn(2, 70, 40, dtype=torch.bfloat16)

    def grads(b=None, bump=False):
        y = _eager_node(ext, x, w, lora_A, lora_B, mag, scales, 0.5, torch.bfloat16, b)
        if bump:
            with torch.no_grad():
                lora_B.add_(0.0)
        return torch.autograd.grad(y, (x, lora_A, lora_B, mag), dy)

    plain = grads()
    for got, want in zip(grads(lora_B.detach().to(torch.bfloat16)), plain, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    wrong = grads((2 * lora_B.detach()).to(torch.bfloat16))
    for name, got, want in zip(("x", "lora_A", "lora_B", "magnitude"), wrong, plain, strict=True):
        moved = name in ("x", "lora_A") and kept
        assert torch.equal(got, want) != moved, name
    with pytest.raises(RuntimeError, match="lora_B was modified by an inplace operation"):
        grads(lora_B.detach().to(torch.bfloat16), bump=True)


def test_cpu_node_checks(ext):
    x, w, lora_A, lora_B, mag = _layer("cpu", torch.float64, torch.float64)
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), 1.0, "eager")[1]

    y = _eager_node(ext, x, w, lora_A, lora_B, mag, scales, 1.0, torch.float64)
    with torch.no_grad():
        lora_B.add_(1.0)
    with pytest.raises(RuntimeError, match="lora_B was modified by an inplace operation"):
        y.sum().backward()
    y = _eager_node(ext, x, w, lora_A, lora_B, mag, scales, 1.0, torch.float64)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.sum().backward()


def test_double_backward_is_refused_on_both_paths(ext):
    """Neither the C++ node nor ``ComposeFunction`` keeps an edge from ``inner`` to its producers, so a gradient of
    their gradient would miss the magnitude's second-order terms: both refuse ``create_graph=True`` (a constant
    upstream gradient would otherwise reach no error node), with the same message, which names the opt-in
    (``flashdora.double_backward``, tests/test_double_backward.py). Never silently wrong second-order gradients."""
    x, w, lora_A, lora_B, mag = _layer("cpu", torch.float64, torch.float64)
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), 1.0, "eager")[1]
    y = _eager_node(ext, x, w, lora_A, lora_B, mag, scales, 1.0, torch.float64)
    with pytest.raises(RuntimeError) as cpp:
        torch.autograd.grad(y.sum(), x, create_graph=True)
    assert C.DOUBLE_BACKWARD in str(cpp.value)
    result, a = F.linear(x, w), F.linear(x, lora_A)
    y = C.ComposeFunction.apply(result, a, None, None, lora_B, mag, scales, 1.0, torch.float64, False)
    with pytest.raises(RuntimeError, match=r"flashdora.double_backward\(\)"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "lx_base"])
@pytest.mark.parametrize(
    ("t", "d_in", "d_out", "r", "scaling"), [(37, 96, 1000, 16, 0.5), (2048, 512, 4096, 384, 1.0)]
)
def test_gpu_node_gives_the_python_paths_bits(ext, monkeypatch, t, d_in, d_out, r, scaling, dropout):
    x, w, lora_A, lora_B, mag = _layer("cuda", torch.bfloat16, torch.float32, t, d_in, d_out, r)
    with torch.no_grad():
        mag.copy_(torch.linalg.vector_norm(w.float(), dim=1) * (1 + 1e-3 * torch.randn_like(mag)))
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), scaling, "triton")[1]
    dy = torch.randn(2, t, d_out, device="cuda", dtype=torch.bfloat16)
    mask = (torch.rand_like(x) > 0.1).to(x.dtype) / 0.9

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            result = F.linear(x, w)
            lx = x * mask if dropout else x
            lx_base = F.linear(lx, w) if dropout else None
            y = C.compose_eager(result, lx, lora_A, lora_B, mag, scales, scaling, lx_base=lx_base)
        torch.full((64 * 2**20,), float("nan"), device="cuda")  # freed at once: the next allocations reuse NaNs
        return y.grad_fn.name(), y.detach(), torch.autograd.grad(y, (x, lora_A, lora_B, mag), dy)

    monkeypatch.setenv("FLASHDORA_NATIVE", "0")
    run()  # tunes the backward kernel
    name, y_py, g_py = run()  # compiles it for the direct launch: the plan the node takes
    assert "FlashDoraComposeBackward" not in name
    monkeypatch.setattr(native.build, "_module", ext)
    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    name, y_nat, g_nat = run()  # the first call: primed (both plans filed), then run in C++
    assert name == "FlashDoraComposeBackward"
    torch.testing.assert_close(y_nat, y_py, rtol=0, atol=0)
    for got, want in zip(g_nat, g_py, strict=True):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _cpp_forward_calls(monkeypatch) -> list:
    """Make the Python path record its calls: after warm-up, none may come (the C++ forward takes them all)."""
    calls = []
    python_path = C._compose_python

    def recorded(*args):
        calls.append(1)
        return python_path(*args)

    monkeypatch.setattr(C, "_compose_python", recorded)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "train"])
@pytest.mark.parametrize(
    ("adapter_dtype", "with_bias", "dropout"),
    [(torch.float32, False, False), (torch.bfloat16, True, False), (torch.float32, False, True)],
    ids=["fp32-adapters", "bf16-bias", "fp32-adapters-lx_base"],
)
def test_gpu_cpp_forward_gives_the_python_paths_bits(ext, monkeypatch, grad, adapter_dtype, with_bias, dropout):
    """Also with dropout's exact form (``lx_base``, no bias: as PEFT calls it)."""
    t, d_in, d_out, r, scaling = 37, 96, 1000, 16, 0.5
    x, w, lora_A, lora_B, mag = _layer("cuda", torch.bfloat16, adapter_dtype, t, d_in, d_out, r)
    bias = torch.randn(d_out, device="cuda", dtype=torch.bfloat16) if with_bias else None
    with torch.no_grad():
        mag.copy_(torch.linalg.vector_norm(w.float(), dim=1) * (1 + 1e-3 * torch.randn_like(mag)))
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), scaling, "triton")[1]
    dy = torch.randn(2, t, d_out, device="cuda", dtype=torch.bfloat16)
    autocast = adapter_dtype == torch.float32  # fp32 adapters under autocast; bf16 ones without
    mask = (torch.rand_like(x) > 0.1).to(x.dtype) / 0.9

    def run():
        with torch.set_grad_enabled(grad), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            result = F.linear(x, w, bias)
            if dropout:
                lx = x * mask
                y = C.compose_eager(result, lx, lora_A, lora_B, mag, scales, scaling, lx_base=F.linear(lx, w))
            else:
                y = C.compose_eager(result, x, lora_A, lora_B, mag, scales, scaling, bias)
        torch.full((64 * 2**20,), float("nan"), device="cuda")  # freed at once: the next allocations reuse NaNs
        grads = torch.autograd.grad(y, (x, lora_A, lora_B, mag), dy) if grad else ()
        return y.detach(), grads, y.grad_fn.name() if grad else None

    monkeypatch.setenv("FLASHDORA_NATIVE", "0")
    for _ in range(3):  # tunes and compiles the kernels
        y_py, g_py, _ = run()
    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    monkeypatch.setattr(native.build, "_module", ext)
    calls = _cpp_forward_calls(monkeypatch)
    y_cpp, g_cpp, name = run()  # the first call finds no plan: primed, then run in C++
    assert calls == []  # the C++ forward took the call
    assert name in (None, "FlashDoraComposeBackward")
    assert not y_cpp.isnan().any()
    torch.testing.assert_close(y_cpp, y_py, rtol=0, atol=0)
    for got, want in zip(g_cpp, g_py, strict=True):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_cpp_forward_declines_what_it_does_not_take_and_gives_up_without_plans(ext, monkeypatch):
    x, w, lora_A, lora_B, mag = _layer("cuda", torch.bfloat16, torch.bfloat16, 5, 32, 48, 4)
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), 1.0, "triton")[1]
    result = F.linear(x, w).detach()
    with torch.no_grad():
        assert ext.forward(result.transpose(0, 1), x, lora_A, lora_B, mag, scales, None, 1.0, -1) is None  # strided
        assert ext.forward(result.cpu(), x.cpu(), lora_A, lora_B, mag, scales, None, 1.0, -1) is None  # not CUDA
    with torch.enable_grad():  # grad on, a frozen magnitude: the Python autograd.Function's case
        assert ext.forward(result, x, lora_A, lora_B, mag.detach(), scales, None, 1.0, -1) is None
    bias = torch.zeros(48, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():  # dropout's lx_base: never beside a bias (PEFT passes none), only contiguous rows
        assert ext.forward(result, x, lora_A, lora_B, mag, scales, bias, 1.0, -1, result.clone()) is None
        assert ext.forward(result, x, lora_A, lora_B, mag, scales, None, 1.0, -1, result.mT.contiguous().mT) is None
    # A shape whose plans never come (never filed here): declined for good after a bounded number of misses.
    odd = torch.randn(3, 17, 48, device="cuda", dtype=torch.bfloat16)
    lx = x.new_empty(3, 17, 32)
    with torch.no_grad():
        got = [ext.forward(odd, lx, lora_A, lora_B, mag, scales, None, 0.25, -1) for _ in range(80)]
    assert got[0] is False and got[-1] is None and got.index(None) <= 65


def test_cpu_forward_is_left_to_the_python_path(ext):
    x, w, lora_A, lora_B, mag = _layer("cpu", torch.float32, torch.float32)
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), 1.0, "eager")[1]
    with torch.no_grad():
        assert ext.forward(F.linear(x, w), x, lora_A, lora_B, mag, scales, None, 1.0, -1) is None  # CUDA only


@pytest.mark.gpu
def test_gpu_every_training_call_hangs_the_cpp_node_also_with_a_new_token_count(ext, monkeypatch):
    """Prime, then run: a shape's first training call (its kernels not compiled yet: a width no other test uses),
    forwards with grad before any backward, and each new token count (dynamic padding) all run the C++ forward and
    hang its node; none runs the Python path."""
    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    monkeypatch.setattr(native.build, "_module", ext)
    _, w, lora_A, lora_B, mag = _layer("cuda", torch.bfloat16, torch.float32, 29, 64, 744, 8)
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), 1.0, "triton")[1]
    calls = _cpp_forward_calls(monkeypatch)
    for t in (29, 1536, 1537, 1600, 2048, 1999):
        x = torch.randn(2, t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ys = [C.compose_eager(F.linear(x, w), x, lora_A, lora_B, mag, scales, 1.0) for _ in range(2)]
        assert all(y.grad_fn.name() == "FlashDoraComposeBackward" for y in ys), t
        sum(y.float().sum() for y in ys).backward()
        assert calls == [], t
    assert not any(p.grad.isnan().any() for p in (lora_A, lora_B, mag))


class _Switching:
    """The extension, with its forward declining the calls ``python(n)`` picks (the n-th call, from 1)."""

    def __init__(self, ext, python):
        self.ext, self.python, self.calls = ext, python, 0

    def forward(self, *args):
        self.calls += 1
        return None if self.python(self.calls) else self.ext.forward(*args)

    def __getattr__(self, name):
        return getattr(self.ext, name)


@pytest.mark.gpu
@pytest.mark.parametrize("first", ["python", "cpp"])
def test_gpu_checkpoint_recompute_may_switch_forward_paths(ext, monkeypatch, first):
    """Should the C++ side decline a forward but take its recompute (or the reverse), under non-reentrant
    checkpointing: both paths save tensors of the same metadata (the checkpoint checks them) and give the same
    gradients. (Prime-then-run makes it never happen by design; this keeps the two paths interchangeable.)"""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    monkeypatch.setattr(native.build, "_module", ext)
    x, w, lora_A, lora_B, mag = _layer("cuda", torch.bfloat16, torch.float32, 29, 64, 520, 8)
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), 1.0, "triton")[1]
    dy = torch.randn(2, 29, 520, device="cuda", dtype=torch.bfloat16)
    inputs = (x, lora_A, lora_B, mag)

    def f(x):  # as the PEFT seam calls it: the sequence number taken before the base layer
        with torch.autocast("cuda", dtype=torch.bfloat16):
            seq = C.after_base()
            return C.compose_eager(F.linear(x, w), x, lora_A, lora_B, mag, scales, 1.0, None, None, seq)

    want = torch.autograd.grad(f(x), inputs, dy)  # (primed: the C++ forward and node)
    switching = _Switching(ext, lambda n: (n == 1) == (first == "python"))
    monkeypatch.setattr(native.build, "_module", switching)
    got = torch.autograd.grad(checkpoint(f, x, use_reentrant=False), inputs, dy)
    assert switching.calls == 2  # the forward, then its recompute
    for g, ref in zip(got, want, strict=True):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_cpp_forward_runs_the_base_layers_backward_first(ext, monkeypatch):
    """The C++ forward gives the LoRA A matmul's node the sequence number ``after_base`` took, as the Python path
    does: the base layer's backward runs first and frees ``g dy`` before the A path's ``d x`` exists (the layer
    benchmark's peak, ``benchmarks/peak_live.py``). With ``seq = -1`` the A path runs first."""
    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    monkeypatch.setattr(native.build, "_module", ext)
    x, w, lora_A, lora_B, mag = _layer("cuda", torch.bfloat16, torch.float32, 29, 64, 520, 8)
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), 1.0, "triton")[1]
    dy = torch.randn(2, 29, 520, device="cuda", dtype=torch.bfloat16)

    def forward(reorder: bool):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            seq = C.after_base() if reorder else -1
            return C.compose_eager(F.linear(x, w), x, lora_A, lora_B, mag, scales, 1.0, None, None, seq)

    for _ in range(3):  # files both plans
        forward(True).backward(dy)
    y = forward(True)
    assert y.grad_fn.name() == "FlashDoraComposeBackward"
    order = backward_order(y)
    assert set(order[:-1]) == {"base"} and order[-1] == "a"
    assert backward_order(forward(False))[0] == "a"


def test_the_cpp_constants_match_the_python_ones():
    """The C++ side mirrors five constants of the Python side (its source compiles them in): they agree."""
    import re

    from flashdora.kernels import compose as kc
    from flashdora.kernels import configs, norm_gemm, scales
    from flashdora.native.build import CSRC

    def cpp(name, file):
        expr = re.search(rf"constexpr int64_t {name} = ([^;]+);", (CSRC / file).read_text()).group(1)
        return eval(expr, {})  # (integer arithmetic: "8 * (1 << 20)")

    assert cpp("kCastBFirst", "compose.h") == kc.CAST_B_FIRST
    assert cpp("kCastBWork", "compose.h") == kc.CAST_B_WORK
    assert cpp("kFusedSmallR", "compose.h") == configs.FUSED_SMALL_R
    assert cpp("kChunkElements", "norm.cpp") == norm_gemm._CHUNK_ELEMENTS
    assert cpp("kScalesBlock", "norm.cpp") == scales.SCALES_BLOCK
