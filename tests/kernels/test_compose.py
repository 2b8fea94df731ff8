"""Triton compose forward/backward vs float64 references and the eager twins; the full op on the Triton path."""

import math

import pytest
import torch

from flashdora.ops.compose import compose_bwd_eager, compose_fwd_eager
from tests.helpers import RTOL, assert_close, dora_inputs, rel_err

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# (leading dims, d_out): 1 token, d_out off every block, 3-D leading dims, enough tokens for several backward splits.
SHAPES = [
    pytest.param((1,), 33, id="1x33"),
    pytest.param((2, 3), 45, id="2x3x45"),
    pytest.param((5, 7, 3), 70, id="5x7x3x70"),
    pytest.param((200,), 40, id="200x40"),
    pytest.param((0,), 16, id="0x16"),
    pytest.param((8192,), 4096, id="8192x4096", marks=pytest.mark.gpu),
    pytest.param((2, 2047), 11008, id="2x2047x11008", marks=pytest.mark.gpu),
    pytest.param((4096,), 28672, id="4096x28672", marks=pytest.mark.gpu),
]
DTYPES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-lora_fp32"),
    pytest.param(torch.float16, torch.float16, id="fp16"),
]


def _kernels():
    from flashdora.kernels import compose

    return compose


def _scales(d_out, device):
    g = (0.5 + torch.rand(d_out, device=device)).float()
    return g, g - 1  # g - 1 is exact here (g in [0.5, 1.5)); ops/compose.scales forms it stably in general


def _ref_fwd(result, lora, g, gm1, scaling, bias, lx_base):
    r, lo, g, gm1 = result.double(), lora.double(), g.double(), gm1.double()
    if lx_base is None:
        inner = r + scaling * lo - (0 if bias is None else bias.double())
        return g * inner + (0 if bias is None else bias.double()), inner
    lb = lx_base.double()
    return r + gm1 * lb + g * scaling * lo, lb + scaling * lo


@pytest.mark.parametrize("lead, d_out", SHAPES)
@pytest.mark.parametrize("dtype, lora_dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("has_lx_base", [False, True], ids=["x", "lx_base"])
def test_compose_fwd(lead, d_out, dtype, lora_dtype, has_bias, has_lx_base, device, poisoned_empty):
    result = torch.randn(*lead, d_out, device=device, dtype=dtype)
    lora = torch.randn(*lead, d_out, device=device, dtype=lora_dtype)
    lx_base = torch.randn(*lead, d_out, device=device, dtype=dtype) if has_lx_base else None
    bias = torch.randn(d_out, device=device, dtype=dtype) if has_bias else None
    g, gm1 = _scales(d_out, device)
    out_y, out_inner = _kernels().compose_fwd(result, lora, torch.stack([g, gm1]), 0.7, bias, lx_base)
    ref_y, ref_inner = _ref_fwd(result, lora, g, gm1, 0.7, bias, lx_base)
    eager_y, eager_inner = compose_fwd_eager(result, lora, g, gm1, 0.7, bias, lx_base)
    assert out_y.dtype == dtype and out_inner.dtype == dtype
    if result.numel() == 0:
        assert out_y.shape == result.shape and out_inner.shape == result.shape
        return
    assert_close(out_y, ref_y, RTOL[dtype], "y")
    assert_close(out_inner, ref_inner, RTOL[dtype], "inner")
    assert_close(out_y, eager_y.double(), RTOL[dtype], "y vs eager")
    assert_close(out_inner, eager_inner.double(), RTOL[dtype], "inner vs eager")


@pytest.mark.parametrize("layout", ["row_slice", "transposed"])
@pytest.mark.parametrize("has_lx_base", [False, True], ids=["x", "lx_base"])
def test_compose_fwd_non_contiguous(layout, has_lx_base, device, poisoned_empty):
    d_out, t = 37, 19
    if layout == "row_slice":  # stride-1 last dim, padded rows: passed as strides, no copy
        result = torch.randn(t, d_out + 11, device=device)[:, :d_out]
        lora = torch.randn(3, t, d_out, device=device)[1]
    else:  # stride-1 first dim: the wrapper copies
        result = torch.randn(d_out, t, device=device).T
        lora = torch.randn(d_out, t, device=device).T
    lx_base = torch.randn(d_out, t, device=device).T if has_lx_base else None
    bias = torch.randn(d_out, device=device)
    g, gm1 = _scales(d_out, device)
    out_y, out_inner = _kernels().compose_fwd(result, lora, torch.stack([g, gm1]), -1.3, bias, lx_base)
    ref_y, ref_inner = _ref_fwd(result, lora, g, gm1, -1.3, bias, lx_base)
    assert_close(out_y, ref_y, RTOL[torch.float32], "y")
    assert_close(out_inner, ref_inner, RTOL[torch.float32], "inner")


def test_compose_fwd_no_inner(device, poisoned_empty):
    result = torch.randn(3, 50, device=device, dtype=torch.bfloat16)
    lora = torch.randn(3, 50, device=device)
    g, gm1 = _scales(50, device)
    out_y, out_inner = _kernels().compose_fwd(result, lora, torch.stack([g, gm1]), 0.5, None, None, save_inner=False)
    ref_y, _ = _ref_fwd(result, lora, g, gm1, 0.5, None, None)
    assert out_inner is None
    assert_close(out_y, ref_y, RTOL[torch.bfloat16], "y")


@pytest.mark.parametrize("has_lx_base", [False, True], ids=["x", "lx_base"])
def test_kernels_read_the_scales_rows_at_their_stride(has_lx_base, device, poisoned_empty):
    """The kernels take the scales as one tensor and its row stride: a padded view (stride != d_out) must give the
    same bits as a packed copy, in the forward, the fused forward and the backward."""
    k, d_out, r = _kernels(), 45, 12
    result = torch.randn(2, 7, d_out, device=device, dtype=torch.bfloat16)
    lx_base = torch.randn_like(result) if has_lx_base else None
    a = torch.randn(2, 7, r, device=device, dtype=torch.bfloat16)
    lora_B = torch.randn(d_out, r, device=device)
    lora = torch.randn_like(result)
    g, gm1 = _scales(d_out, device)
    padded = torch.randn(3, d_out + 11, device=device)[:, :d_out]
    padded.copy_(torch.stack([g, gm1, 1 / g]))
    packed = padded.contiguous()
    assert padded.stride(0) != d_out and torch.equal(padded, packed)
    for fn in (
        lambda sc: k.compose_fwd(result, lora, sc, 0.7, None, lx_base),
        lambda sc: k.compose_fwd_fused(result, a, lora_B, sc, 0.7, None, lx_base),
        lambda sc: k.compose_bwd(lora, result, sc, has_lx_base, 1.5),
    ):
        for got, want in zip(fn(padded), fn(packed)):
            assert (got is None and want is None) or torch.equal(got, want)


# SHAPES without their GPU mark (the split is host arithmetic), with the SMs they meet: 2 under the interpreter, an
# H100's 132 for the GPU's
SPLIT_CASES = [pytest.param(*p.values, 132 if p.marks else 2, id=p.id) for p in SHAPES]


@pytest.mark.parametrize("lead, d_out, sms", SPLIT_CASES)
def test_the_backward_splits_the_test_shapes_tokens(monkeypatch, lead, d_out, sms):
    """``test_compose_bwd``'s shapes with more tokens than one program's range (the CPU's under the interpreter,
    which counts 2 SMs; the GPU's on an H100's 132) give the backward several token ranges, so its partial sums and
    their fixed-order sum are what that test checks, whatever ``COMPOSE_BWD_TARGET_PROGRAMS_PER_SM`` is."""
    from flashdora.kernels import compose, configs

    tokens = math.prod(lead)
    if tokens <= configs.COMPOSE_BWD_ROW_QUANTUM:
        pytest.skip("one program's range of tokens")
    monkeypatch.setattr(configs, "sm_count", lambda device: sms)
    monkeypatch.setattr(compose, "_BWD_SPLIT", {})
    rows, like = compose._bwd_split(tokens, d_out, torch.zeros(3, d_out))
    assert like.shape == (-(tokens // -rows), d_out) and like.shape[0] > 1
    assert rows % configs.COMPOSE_BWD_ROW_QUANTUM == 0


@pytest.mark.parametrize("lead, d_out", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("has_lx_base", [False, True], ids=["x", "lx_base"])
@pytest.mark.parametrize("has_inner", [True, False], ids=["inner", "noinner"])
def test_compose_bwd(lead, d_out, dtype, has_lx_base, has_inner, device, poisoned_empty):
    dy = torch.randn(*lead, d_out, device=device, dtype=dtype)
    inner = torch.randn(*lead, d_out, device=device, dtype=dtype) if has_inner else None
    g, gm1 = _scales(d_out, device)
    inv = 0.5 + torch.rand(d_out, device=device)  # 1 / norm
    scales = torch.stack([g, gm1, inv])
    gdy_scale = 1.5 if has_lx_base else 1.0  # with lx_base, _bwd asks for PEFT's (dy s) g
    out_gdy, out_dlb, out_dg = _kernels().compose_bwd(dy, inner, scales, has_lx_base, gdy_scale)
    assert out_gdy.shape == dy.shape and out_gdy.dtype == dtype
    assert (out_dlb is not None) == has_lx_base and (out_dg is not None) == has_inner
    d64 = dy.double()
    if dy.numel() > 0:
        assert_close(out_gdy, gdy_scale * g.double() * d64, RTOL[dtype], "(dy s) g")
        eager_gdy = compose_bwd_eager(dy, inner, scales, has_lx_base, gdy_scale)[0]
        assert_close(out_gdy, eager_gdy.double(), RTOL[dtype], "(dy s) g vs eager")
        if has_lx_base:
            assert out_dlb.dtype == dtype
            assert_close(out_dlb, gm1.double() * d64, RTOL[dtype], "(g - 1) dy")
    if has_inner:
        ref_dg = (d64 * inner.double()).reshape(-1, d_out).sum(0) * inv.double()
        assert out_dg.shape == (d_out,) and out_dg.dtype == torch.float32
        if dy.numel() == 0:
            assert torch.equal(out_dg, torch.zeros_like(out_dg))
        else:
            assert_close(out_dg, ref_dg, RTOL[torch.float32], "dg")
            eager_dg = compose_bwd_eager(dy, inner, scales, has_lx_base)[2]
            assert_close(out_dg, eager_dg.double(), RTOL[torch.float32], "dg vs eager")
            again = _kernels().compose_bwd(dy, inner, scales, has_lx_base)[2]
            assert torch.equal(out_dg, again), "dg is not bitwise reproducible"


@pytest.mark.parametrize(
    "lead, d_out, r",
    [
        pytest.param((1,), 33, 1, id="1x33-r1"),
        pytest.param((5, 7, 3), 70, 20, id="5x7x3x70-r20"),
        pytest.param((8192,), 4096, 16, id="8192x4096-r16", marks=pytest.mark.gpu),
        pytest.param((2, 2047), 11008, 384, id="2x2047x11008-r384", marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize(
    "dtype, a_dtype, b_dtype",
    [
        pytest.param(torch.float32, torch.float32, torch.float32, id="fp32"),
        pytest.param(torch.bfloat16, torch.float32, torch.float32, id="bf16-lora_fp32"),
        pytest.param(torch.float16, torch.float16, torch.float32, id="fp16"),
        pytest.param(torch.bfloat16, torch.bfloat16, torch.float32, id="bf16-fp32_B"),  # autocast, fp32 adapters
        pytest.param(torch.bfloat16, torch.bfloat16, torch.bfloat16, id="bf16-bf16_B"),  # lora_B cast first
        pytest.param(torch.float16, torch.float16, torch.float16, id="fp16-fp16_B"),
    ],
)
@pytest.mark.parametrize("has_lx_base", [False, True], ids=["x", "lx_base"])
def test_compose_fwd_fused(lead, d_out, r, dtype, a_dtype, b_dtype, has_lx_base, device, poisoned_empty):
    result = torch.randn(*lead, d_out, device=device, dtype=dtype)
    a = torch.randn(*lead, r, device=device, dtype=a_dtype)
    lora_B = (torch.randn(d_out, r, device=device) / r**0.5).to(b_dtype)
    lx_base = torch.randn(*lead, d_out, device=device, dtype=dtype) if has_lx_base else None
    bias = torch.randn(d_out, device=device, dtype=dtype)
    g, gm1 = _scales(d_out, device)
    out_y, out_inner = _kernels().compose_fwd_fused(result, a, lora_B, torch.stack([g, gm1]), 0.7, bias, lx_base)
    lora = a.double() @ lora_B.to(a_dtype).double().T
    ref_y, ref_inner = _ref_fwd(result, lora, g, gm1, 0.7, bias, lx_base)
    assert_close(out_y, ref_y, RTOL[dtype], "y")
    assert_close(out_inner, ref_inner, RTOL[dtype], "inner")
    out_y2, no_inner = _kernels().compose_fwd_fused(
        result, a, lora_B, torch.stack([g, gm1]), 0.7, bias, lx_base, save_inner=False
    )
    assert no_inner is None and torch.equal(out_y2, out_y)


@pytest.mark.parametrize(
    "r, a_dtype, b_dtype",
    [
        (48, torch.bfloat16, torch.float32),
        (48, torch.bfloat16, torch.bfloat16),
        (48, torch.float32, torch.float32),
        (16, torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compose_fwd_fused_runs_the_tile_its_pruning_puts_first(r, a_dtype, b_dtype, dev):
    """The launch runs, and files under its key, the config ``configs.prune_fused`` puts first for the call's rank and
    dtypes (on the CPU the interpreter's one config: the key's wiring; on a GPU the tile itself)."""
    from flashdora.kernels import configs, launcher

    kc = _kernels()
    result = torch.randn(64, 96, device=dev, dtype=torch.bfloat16)
    a = torch.randn(64, r, device=dev, dtype=a_dtype)
    lora_B = torch.randn(96, r, device=dev).to(b_dtype)
    scales = torch.stack(_scales(96, dev))
    kc.compose_fwd_fused(result, a, lora_B, scales, 0.5)
    *_, (key, args, _flags) = kc._fused_call(result, a, lora_B, scales, 0.5, None, None, True)
    kernel = kc._compose_fused_fwd_kernel
    ran, _ = launcher._TUNED[(id(kernel), key)]
    want = configs.prune_fused(kernel.configs, dict(zip(kernel.arg_names, args)))[0]
    assert ran == want.all_kwargs()


@pytest.mark.gpu
@pytest.mark.parametrize("r", [16, 384])
def test_compose_fwd_fused_lora_B_cast_first_or_in_registers(r, poisoned_empty):
    """A float32 ``lora_B`` (cast in registers) and the same ``lora_B`` cast to bf16 first (above r = 32 another
    tile: ``configs.prune_fused``) round the same operands: the outputs agree to bf16 rounding, against float64 too,
    at a token count where the layers cast first at r = 384 (``CAST_B_WORK``)."""
    kc = _kernels()
    n = 1024
    t = kc._cdiv(kc.CAST_B_WORK, n * 384)
    result = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(t, r, device="cuda", dtype=torch.bfloat16)
    lora_B = torch.randn(n, r, device="cuda") / r**0.5
    g, gm1 = _scales(n, "cuda")
    y32, inner32 = kc.compose_fwd_fused(result, a, lora_B, torch.stack([g, gm1]), 0.7)
    y16, inner16 = kc.compose_fwd_fused(result, a, lora_B.bfloat16(), torch.stack([g, gm1]), 0.7)
    ref_y, ref_inner = _ref_fwd(result, a.double() @ lora_B.bfloat16().double().T, g, gm1, 0.7, None, None)
    for y, inner in ((y32, inner32), (y16, inner16)):
        assert_close(y, ref_y, RTOL[torch.bfloat16], "y")
        assert_close(inner, ref_inner, RTOL[torch.bfloat16], "inner")
    assert_close(y16, y32.double(), RTOL[torch.bfloat16], "y, cast first vs in registers")


def _grads(monkeypatch, backend, inputs, lora_x):
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    from flashdora import dora_linear

    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items() if torch.is_tensor(v)}
    leaves.setdefault("bias", None)
    lx = None if lora_x is None else lora_x.detach().clone().requires_grad_(True)
    out = dora_linear(**leaves, scaling=inputs["scaling"], lora_x=lx)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype).to(out.device)
    out.backward(dy)
    grads = {k: v.grad for k, v in leaves.items() if v is not None}
    if lx is not None:
        grads["lora_x"] = lx.grad
    return out, grads


@pytest.mark.parametrize("with_lora_x", [False, True], ids=["x", "lora_x"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "d_in, d_out, r, lead",
    [
        pytest.param(24, 40, 5, (2, 3), id="24-40-r5"),
        pytest.param(8, 19, 12, (7,), id="8-19-r12"),  # r > d_in
        pytest.param(4096, 4096, 64, (4, 512), id="4096-4096-r64", marks=pytest.mark.gpu),
    ],
)
def test_dora_linear_triton_equals_eager(d_in, d_out, r, lead, bias, with_lora_x, device, monkeypatch):
    inputs = dora_inputs(d_in, d_out, r, lead=lead, device=device, bias=bias)
    lora_x = torch.randn_like(inputs["x"]) if with_lora_x else None
    ref, ref_grads = _grads(monkeypatch, "eager", inputs, lora_x)
    out, out_grads = _grads(monkeypatch, "triton", inputs, lora_x)
    # The GPU's eager norm runs a different GEMM than the kernel; fp32-accurate either way.
    assert_close(out, ref.double(), RTOL[torch.float32], "output")
    assert set(out_grads) == set(ref_grads)
    for name, ref_d in ref_grads.items():
        assert ref_d is not None and out_grads[name] is not None, name
        assert_close(out_grads[name], ref_d.double(), RTOL[torch.float32], f"d{name}")


def _peft_bf16_output(inputs):
    """PEFT's own DoRA layer, all in bf16, on the same parameter values."""
    from peft import LoraConfig, get_peft_model

    w = inputs["weight"]
    d_out, d_in = w.shape
    r = inputs["lora_A"].shape[0]
    lin = torch.nn.Linear(d_in, d_out, bias=inputs["bias"] is not None)
    model = get_peft_model(
        torch.nn.Sequential(lin).to(w.device, torch.bfloat16),
        LoraConfig(r=r, lora_alpha=inputs["scaling"] * r, use_dora=True, target_modules=["0"], lora_dropout=0.0),
        autocast_adapter_dtype=False,  # keep the adapters and magnitude in bf16, as the brief's PEFT formula has them
    )
    layer = model.base_model.model[0]
    assert layer.scaling["default"] == pytest.approx(inputs["scaling"])
    assert layer.lora_A["default"].weight.dtype == torch.bfloat16
    assert layer.lora_magnitude_vector["default"].weight.dtype == torch.bfloat16
    with torch.no_grad():
        layer.base_layer.weight.copy_(w)
        if inputs["bias"] is not None:
            layer.base_layer.bias.copy_(inputs["bias"])
        layer.lora_A["default"].weight.copy_(inputs["lora_A"])
        layer.lora_B["default"].weight.copy_(inputs["lora_B"])
        layer.lora_magnitude_vector["default"].weight.copy_(inputs["magnitude"])
    model.eval()
    with torch.no_grad():
        return model(inputs["x"])


@pytest.mark.parametrize(
    "d_in, d_out, r, lead",
    [
        pytest.param(64, 96, 10, (4, 16), id="64-96-r10"),
        pytest.param(1024, 2048, 16, (2, 256), id="1024-2048-r16", marks=pytest.mark.gpu),
    ],
)
def test_bf16_error_at_most_peft(d_in, d_out, r, lead, device, monkeypatch):
    """With g within 1e-3 of 1, our bf16 output is no further from float64 than PEFT's bf16 formula's output."""
    inputs = dora_inputs(d_in, d_out, r, lead=lead, dtype=torch.bfloat16, device=device, g_near_one=True)
    inputs["magnitude"] = inputs["magnitude"].to(torch.bfloat16)  # PEFT's magnitude lives in the model dtype
    peft_out = _peft_bf16_output(inputs)
    monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    from flashdora import dora_linear
    from flashdora.reference import dora_linear_ref

    with torch.no_grad():
        out = dora_linear(**inputs)
        ref = dora_linear_ref(**{k: v.double() if torch.is_tensor(v) else v for k, v in inputs.items()})
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out_err, peft_err = rel_err(out, ref), rel_err(peft_out, ref)
    assert out_err <= peft_err, f"flashdora bf16 error {out_err:.3e} > PEFT's {peft_err:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("bias_dtype", [None, "same", torch.float32], ids=["nobias", "bias_same", "bias_fp32"])
@pytest.mark.parametrize("has_lx_base", [False, True], ids=["x", "lx_base"])
def test_compose_fwd_rounds_like_its_eager_twin(dtype, bias_dtype, has_lx_base, poisoned_empty):
    """Kernel and eager twin round at the same points (PEFT's: ``result - bias`` in their promoted dtype, one final
    rounding): bit for bit under the interpreter, which has no fused multiply-add (the GPU may contract one)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("bitwise only without FMA contraction: the CPU interpreter")
    torch.manual_seed(0)
    t, n = 37, 70
    result, lora = torch.randn(t, n, dtype=dtype) * 4, torch.randn(t, n, dtype=dtype)
    lx_base = torch.randn(t, n, dtype=dtype) if has_lx_base else None
    bias = None if bias_dtype is None else torch.randn(n, dtype=dtype if bias_dtype == "same" else bias_dtype)
    g = (0.5 + torch.rand(n)).float()
    gm1 = g - 1
    y, inner = _kernels().compose_fwd(result, lora, torch.stack([g, gm1]), 1.5, bias, lx_base)
    y_eager, inner_eager = compose_fwd_eager(result, lora, g, gm1, 1.5, bias, lx_base)
    assert torch.equal(y, y_eager) and torch.equal(inner, inner_eager)
