import pytest
import torch

from flashdora import dora_linear, stats
from flashdora.ops.compose import compose
from flashdora.ops.norm import scales
from flashdora.reference import dora_linear_ref, row_norm_ref
from tests.helpers import RTOL, assert_close, dora_inputs, rel_err

GRAD_NAMES = ("x", "lora_x", "weight", "bias", "lora_A", "lora_B", "magnitude")


def _run(fn, i, lora_x, dy):
    """Output and the gradients of every input (None where an input is absent)."""
    leaves = {
        k: (v.detach().clone().requires_grad_() if v is not None else None) for k, v in i.items() if k != "scaling"
    }
    lx = None if lora_x is None else lora_x.detach().clone().requires_grad_()
    out = fn(
        leaves["x"],
        leaves["weight"],
        leaves["bias"],
        leaves["lora_A"],
        leaves["lora_B"],
        leaves["magnitude"],
        i["scaling"],
        lora_x=lx,
    )
    out.backward(dy)
    grads = {
        k: leaves[k].grad for k in ("x", "weight", "bias", "lora_A", "lora_B", "magnitude") if leaves[k] is not None
    }
    grads["lora_x"] = None if lx is None else lx.grad
    return out, grads


def _double(i):
    return {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in i.items()}


CASES = [
    pytest.param(dict(d_in=32, d_out=24, r=8, lead=(2, 5)), id="3d-32x24-r8"),
    pytest.param(dict(d_in=17, d_out=9, r=1, lead=(7,)), id="2d-odd-r1"),
    pytest.param(dict(d_in=8, d_out=12, r=16, lead=(1, 1)), id="r>d_in-1token"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_lora_x", [False, True], ids=["plain", "lora_x"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_dora_linear_output_and_grads_match_float64(case, dtype, with_lora_x, bias, monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(case["d_in"], case["d_out"], case["r"], lead=case["lead"], dtype=dtype, bias=bias)
    i["magnitude"] = i["magnitude"].to(dtype)
    lora_x = torch.nn.functional.dropout(torch.randn_like(i["x"]), 0.2) if with_lora_x else None
    dy = torch.randn(*case["lead"], case["d_out"], dtype=dtype)
    out, grads = _run(dora_linear, i, lora_x, dy)
    ref, ref_grads = _run(dora_linear_ref, _double(i), None if lora_x is None else lora_x.double(), dy.double())
    assert out.dtype == dtype
    tol = RTOL[dtype]
    assert_close(out, ref, tol, "y")
    for name in GRAD_NAMES:
        if ref_grads.get(name) is None:
            assert grads.get(name) is None, name
            continue
        assert grads[name].dtype == dtype, name
        assert_close(grads[name], ref_grads[name], 3 * tol if dtype != torch.float32 else 1e-4, f"d{name}")


def test_non_contiguous_x(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(16, 10, 4, lead=(6, 3))
    i["x"] = i["x"].transpose(0, 1)  # [3, 6, 16], non-contiguous
    assert not i["x"].is_contiguous()
    dy = torch.randn(3, 6, 10)
    out, grads = _run(dora_linear, i, None, dy)
    ref, ref_grads = _run(dora_linear_ref, _double(i), None, dy.double())
    assert_close(out, ref, 1e-5, "y")
    for name in ("x", "lora_A", "lora_B", "magnitude"):
        assert_close(grads[name], ref_grads[name], 1e-4, f"d{name}")


@pytest.mark.parametrize("with_lora_x", [False, True], ids=["plain", "lora_x"])
def test_compose_gradcheck_float64(with_lora_x, monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = _double(dora_inputs(6, 5, 3, lead=(4,)))
    norm = row_norm_ref(i["weight"], i["lora_A"], i["lora_B"], i["scaling"])  # a constant for the op
    result = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    lx = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    lx_base = torch.randn(4, 5, dtype=torch.float64, requires_grad=True) if with_lora_x else None
    bias = None if with_lora_x else i["bias"].requires_grad_()
    a, b, m = (i[k].requires_grad_() for k in ("lora_A", "lora_B", "magnitude"))

    def f(result, lx, lx_base, bias, a, b, m):
        return compose(result, lx, a, b, m, scales(m, norm), 0.7, bias=bias, lx_base=lx_base)

    assert torch.autograd.gradcheck(f, (result, lx, lx_base, bias, a, b, m))


def test_autocast_bf16_with_fp32_adapters(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(64, 48, 8, lead=(4, 8))
    i["weight"] = i["weight"].bfloat16()
    i["bias"] = i["bias"].bfloat16()
    dy = torch.randn(4, 8, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = _run(dora_linear, i, None, dy.bfloat16())
    ref, ref_grads = _run(dora_linear_ref, _double(i), None, dy.double())
    assert out.dtype == torch.bfloat16
    assert grads["lora_A"].dtype == grads["lora_B"].dtype == grads["magnitude"].dtype == torch.float32
    assert_close(out, ref, RTOL[torch.bfloat16], "y")
    for name in ("x", "lora_A", "lora_B", "magnitude"):
        assert_close(grads[name], ref_grads[name], 3 * RTOL[torch.bfloat16], f"d{name}")


@pytest.mark.parametrize("with_lora_x", [False, True], ids=["plain", "lora_x"])
def test_large_lora_B_cast_first_gives_the_same_bits(with_lora_x, device, monkeypatch):
    """A large float32 ``lora_B`` is cast to bf16 before the fused kernel instead of in its registers: the same
    rounding, so the output and every gradient must be bitwise those of the in-register cast."""
    from flashdora.kernels import compose as kc

    monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    i = dora_inputs(40, 24, 8, lead=(3, 5), device=device)
    i["weight"], i["bias"] = i["weight"].bfloat16(), i["bias"].bfloat16()
    lora_x = torch.nn.functional.dropout(torch.randn_like(i["x"]), 0.2).bfloat16() if with_lora_x else None
    dy = torch.randn(3, 5, 24, device=device).bfloat16()
    runs = []
    for threshold in (2**40, 0):  # never cast first, always cast first
        monkeypatch.setattr(kc, "CAST_B_FIRST", threshold)
        monkeypatch.setattr(kc, "CAST_B_WORK", 2**62)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            runs.append(_run(dora_linear, i, lora_x, dy))
    (out0, grads0), (out1, grads1) = runs
    assert torch.equal(out0, out1)
    for name, grad in grads0.items():
        assert (grad is None and grads1[name] is None) or torch.equal(grad, grads1[name]), name


def _peft_formula_bf16(i, lora_x):
    """PEFT's DoRA arithmetic for a bf16 layer with an fp32 magnitude: base and lora matmuls in bf16, the norm
    rounded to bf16 (PEFT computes it in the input dtype), then g = m / norm and (g - 1) * base as PEFT forms them."""
    x, w, a, b = (i[k].bfloat16() for k in ("x", "weight", "lora_A", "lora_B"))
    lx = lora_x.bfloat16()
    norm = torch.linalg.vector_norm((w.float() + i["scaling"] * (b @ a).float()), dim=1).bfloat16()
    g = (i["magnitude"] / norm).view(1, -1)
    result = torch.nn.functional.linear(x, w, i["bias"].bfloat16())
    base = torch.nn.functional.linear(lx, w)
    lora = torch.nn.functional.linear(torch.nn.functional.linear(lx, a), b)
    return (result + (g - 1) * base + g * lora * i["scaling"]).bfloat16()


def test_bf16_error_no_worse_than_peft_near_g_equal_1(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(256, 192, 16, lead=(64,), g_near_one=True)
    lora_x = torch.nn.functional.dropout(i["x"], 0.1)
    ref = dora_linear_ref(
        *(_double(i)[k] for k in ("x", "weight", "bias", "lora_A", "lora_B", "magnitude")),
        i["scaling"],
        lora_x=lora_x.double(),
    )
    bf = {k: (v.bfloat16() if isinstance(v, torch.Tensor) and k != "magnitude" else v) for k, v in i.items()}
    out = dora_linear(
        bf["x"],
        bf["weight"],
        bf["bias"],
        bf["lora_A"],
        bf["lora_B"],
        i["magnitude"],
        i["scaling"],
        lora_x=lora_x.bfloat16(),
    )
    ours, peft = rel_err(out, ref), rel_err(_peft_formula_bf16(i, lora_x), ref)
    assert ours <= peft, (ours, peft)


def test_zero_norm_row_outputs_bias_and_zero_grads(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(12, 6, 3, lead=(5,))
    i["weight"][1] = 0
    i["lora_B"][1] = 0
    dy = torch.randn(5, 6)
    out, grads = _run(dora_linear, i, None, dy)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 1], i["bias"][1].expand(5))
    for name, grad in grads.items():
        assert grad is None or torch.isfinite(grad).all(), name
    assert grads["magnitude"][1] == 0


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_inplace_edit_of_lora_B_before_backward_raises(backend, device, monkeypatch):
    """``lora_B`` rides on the autograd context (not ``save_for_backward``), so its version is checked by hand: an
    in-place edit between forward and backward must fail as torch's own check would, never use the new values."""
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    i = dora_inputs(16, 8, 4, lead=(3,), device=device)
    lora_B = i["lora_B"].requires_grad_()
    out = dora_linear(i["x"], i["weight"], i["bias"], i["lora_A"], lora_B, i["magnitude"], i["scaling"])
    with torch.no_grad():
        lora_B.mul_(2.0)
    with pytest.raises(RuntimeError, match="lora_B was modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_backward_of_a_non_contiguous_output_gradient(backend, device, monkeypatch):
    """A layer output used through a transpose hands backward a non-contiguous ``dy``; the gradients must equal those
    of the same values given contiguous."""
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    i = dora_inputs(32, 48, 8, lead=(3, 4), device=device)
    w = torch.randn(4, 3, 48, device=device)
    grads = []
    for transposed in (True, False):
        params = [i[k].detach().clone().requires_grad_() for k in ("x", "lora_A", "lora_B", "magnitude")]
        x, lora_A, lora_B, magnitude = params
        y = dora_linear(x, i["weight"], i["bias"], lora_A, lora_B, magnitude, i["scaling"])
        loss = (y.transpose(0, 1) * w).sum() if transposed else (y * w.transpose(0, 1).contiguous()).sum()
        loss.backward()
        grads.append([p.grad for p in params])
    for got, want in zip(*grads):
        assert torch.equal(got, want)


def test_float64_layer_under_autocast_runs():
    """Autocast leaves float64 tensors as they are: the LoRA A matmul must still get operands of one dtype."""
    i = dora_inputs(16, 8, 4, lead=(3,), dtype=torch.float64)
    args = (i["x"], i["weight"], i["bias"], i["lora_A"], i["lora_B"], i["magnitude"], i["scaling"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dora_linear(*args)
    assert torch.isfinite(out).all() and rel_err(out.double(), dora_linear(*args)) < 3e-2


@pytest.mark.gpu
def test_inference_under_autocast_keeps_no_cast_copy_of_lora_A():
    """Without grad, no cast copy of a trainable lora_A outlives the call: autocast caches casts of trainable leaves
    until its region ends, which over a model's forward held 1 GiB on llama3-8b at r = 384."""
    i = dora_inputs(256, 512, 64, lead=(4,), device="cuda")
    lora_A = i["lora_A"].requires_grad_()  # a trainable leaf, as PEFT's adapters are
    args = (i["x"], i["weight"], i["bias"], lora_A, i["lora_B"], i["magnitude"], i["scaling"])
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        dora_linear(*args)  # cuBLAS workspaces and the like, kept by torch for the process
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        before = torch.cuda.memory_allocated()
        out = dora_linear(*args)
        del out
        assert torch.cuda.memory_allocated() == before


def test_inference_under_autocast_casts_lora_A_without_caching_it():
    """CPU twin of the test above: two calls in one autocast region without grad each cast lora_A. A cast cached
    by autocast (kept until the region ends) would show as one cast for both."""
    from torch.utils._python_dispatch import TorchDispatchMode

    i = dora_inputs(16, 8, 4, lead=(3,))
    lora_A = i["lora_A"].requires_grad_()  # a trainable leaf, as PEFT's adapters are
    args = (i["x"], i["weight"], None, lora_A, i["lora_B"], i["magnitude"], i["scaling"])  # (float32 W: no norm cast)

    class CastsOfA(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].shape == lora_A.shape:
                CastsOfA.n += 1
            return func(*args, **(kwargs or {}))

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad(), CastsOfA():
        dora_linear(*args)
        dora_linear(*args)
    assert CastsOfA.n == 2


def test_scales_are_exact_near_one():
    norm = torch.tensor([3.0, 5.0, 0.0], dtype=torch.float32)
    m = norm * torch.tensor([1 + 2**-20, 1.0, 1.0])
    g, gm1, inv = scales(m, norm)
    assert g.dtype == torch.float32
    assert gm1[0].item() == pytest.approx(2**-20, rel=1e-6) and gm1[1] == 0
    assert (g[2], gm1[2], inv[2]) == (0, -1, 0)


def test_counts_eager_calls(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(8, 4, 2)
    before = stats().get("eager", 0)
    dora_linear(i["x"], i["weight"], i["bias"], i["lora_A"], i["lora_B"], i["magnitude"], i["scaling"])
    assert stats()["eager"] == before + 1


def _args(**change):
    args = dict(
        x=torch.randn(3, 8),
        weight=torch.randn(6, 8),
        bias=torch.randn(6),
        lora_A=torch.randn(4, 8),
        lora_B=torch.randn(6, 4),
        magnitude=torch.rand(6),
        scaling=0.5,
    )
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(x=torch.randn(3, 7)), ValueError, r"x expected shape \[\.\.\., 8\]"),
        (dict(lora_B=torch.randn(6, 2)), ValueError, r"lora_B expected shape \[d_out, r\] = \[6, 4\]"),
        (dict(magnitude=torch.rand(5)), ValueError, r"magnitude expected shape \[6\]"),
        (dict(bias=torch.randn(7)), ValueError, r"bias expected shape \[6\]"),
        (dict(x=torch.randn(3, 8).double()), TypeError, "x expected dtype torch.float32"),
        (dict(magnitude=torch.ones(6, dtype=torch.int64)), TypeError, "magnitude expected a floating dtype"),
        (dict(scaling=float("inf")), ValueError, "scaling expected a finite number, got inf"),
        (dict(scaling=10**400), ValueError, "scaling expected a finite number, got one beyond float's range"),
        (dict(magnitude=torch.rand(6, device="meta")), ValueError, "magnitude expected device cpu"),
        (dict(bias=torch.randn(6).double()), TypeError, r"bias expected dtype torch.float32 \(the dtype of weight"),
    ],
)
def test_named_errors(change, error, match):
    args = _args(**change)
    with pytest.raises(error, match=f"dora_linear: .*{match}"):
        dora_linear(
            args.pop("x"),
            **{k: args[k] for k in ("weight", "bias", "lora_A", "lora_B", "magnitude")},
            scaling=args["scaling"],
        )


def test_lora_x_shape_error():
    args = _args()
    with pytest.raises(ValueError, match=r"dora_linear: lora_x expected shape \[3, 8\]"):
        dora_linear(**args, lora_x=torch.randn(2, 8))


def test_lora_x_dtype_error():
    args = _args()
    with pytest.raises(TypeError, match=r"dora_linear: lora_x expected dtype torch.float32 \(the dtype of x"):
        dora_linear(**args, lora_x=torch.randn(3, 8).double())


@pytest.mark.parametrize("lora_x", [False, True])
def test_dora_linear_on_meta_tensors_gives_shapes(lora_x):
    """Meta tensors (shape inference, meta-device initialisation) have no autocast state to ask: ``dora_linear``
    still gives the output's shape and dtype (it raised "unknown device type for autocast")."""
    i = dora_inputs(12, 8, 2, lead=(3, 5), device="meta")
    x = i["x"]
    out = dora_linear(x, i["weight"], i["bias"], i["lora_A"], i["lora_B"], i["magnitude"], 0.5,
                      lora_x=torch.empty_like(x) if lora_x else None)  # fmt: skip
    assert out.device.type == "meta" and out.shape == (3, 5, 8) and out.dtype == x.dtype


def test_cast_b_first_by_size_and_by_work():
    """lora_B is cast before the fused forward when it is large, or when tokens x its elements (each row tile re-reads
    it) pass ``CAST_B_WORK`` at a rank above the small-rank tile's; the fused kernel's tile follows the operand it then
    gets (``configs.prune_fused``)."""
    from flashdora.kernels import compose as kc
    from flashdora.kernels import configs

    r_big, r_small = configs.FUSED_SMALL_R + 1, configs.FUSED_SMALL_R
    many = kc._cdiv(kc.CAST_B_WORK, 4096 * r_big)  # tokens from which a [4096, r_big] lora_B is cast first
    assert 4096 * r_big * (many - 1) < kc.CAST_B_WORK <= 4096 * r_big * many
    assert not kc.cast_b_first(torch.empty(4096, r_big), many - 1)
    assert kc.cast_b_first(torch.empty(4096, r_big), many)
    assert kc.cast_b_first(torch.empty(8192, r_big), many // 2 + 1)  # twice the rows: half the tokens
    assert not kc.cast_b_first(torch.empty(4096, r_small), 2 * many)
    # the 8B model's shapes at r = 384: gate/up (d_out 14336) from 512 tokens a call, q/o/down (4096) from 2048
    assert kc.cast_b_first(torch.empty(14336, 384), 512) and not kc.cast_b_first(torch.empty(14336, 384), 256)
    assert kc.cast_b_first(torch.empty(4096, 384), 2048) and not kc.cast_b_first(torch.empty(4096, 384), 1024)
    assert kc.cast_b_first(torch.empty(kc.CAST_B_FIRST // r_small, r_small), 1)

    tiles = ["fp32 lora_B", "16-bit lora_B", "small r"]  # the roles of COMPOSE_FUSED's three GPU configs, in order
    f32, bf16, f16 = torch.empty(1), torch.empty(1, dtype=torch.bfloat16), torch.empty(1, dtype=torch.float16)
    cases = [(r_big, bf16, f32, 0), (r_big, bf16, bf16, 1), (r_big, f16, f16, 1), (r_big, f32, f32, 0)]
    cases += [(r_big, f16, bf16, 0), (r_small, bf16, f32, 2), (r_small, bf16, bf16, 2), (r_small, f32, f32, 2)]
    for r, a, b, want in cases:
        got = configs.prune_fused(tiles, {"R": r, "p_a": a, "p_lora_B": b})
        assert got[0] == tiles[want] and sorted(got) == sorted(tiles), (r, a.dtype, b.dtype)
    assert configs.prune_fused(["one"], {"R": r_big, "p_a": bf16, "p_lora_B": f32}) == ["one"]
