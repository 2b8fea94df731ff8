"""``flashdora.native``'s ``norm_scales``: a norm cache miss in C++, the same launches as the Python path's
``norm_and_scales`` (``norm_gemm``'s, or ``norm_small``'s one kernel up to its rank), so the same bits (GPU); what it
declines, and that the cache takes it (GPU)."""

import pytest
import torch

import flashdora
from flashdora import dispatch, native
from flashdora.kernels import norm as kn
from flashdora.kernels import norm_small
from flashdora.kernels.norm_small import MAX_R
from flashdora.native import bridge as native_bridge
from flashdora.ops import norm as ops_norm


def _layer(d_out, d_in, r, w_dtype, ab_dtype, transposed=False, device="cuda"):
    if transposed:  # GPT-2 Conv1D keeps [d_in, d_out]; the layer hands over its transpose
        weight = (torch.randn(d_in, d_out, device=device) / d_in**0.5).to(w_dtype).T
    else:
        weight = (torch.randn(d_out, d_in, device=device) / d_in**0.5).to(w_dtype)
    lora_A = (torch.randn(r, d_in, device=device) / d_in**0.5).to(ab_dtype)
    lora_B = (torch.randn(d_out, r, device=device) / r**0.5).to(ab_dtype)
    magnitude = torch.linalg.vector_norm(weight.float(), dim=1).to(ab_dtype) * 1.01
    w_sq = ops_norm.weight_sq(weight, weight.is_cuda)
    return weight, lora_A, lora_B, magnitude, w_sq


def _use(ext, monkeypatch):
    """``ext`` as the loaded extension for this test (the norm's miss and the compose)."""

    monkeypatch.setattr(native.build, "_module", ext)


def _poison():
    torch.full((64 * 2**20,), float("nan"), device="cuda")  # freed at once: the next allocations reuse NaNs


def test_cpu_tensors_are_declined(ext):
    weight, lora_A, lora_B, magnitude, w_sq = _layer(8, 16, 4, torch.bfloat16, torch.float32, device="cpu")
    assert ext.norm_scales(weight, lora_A, lora_B, magnitude, w_sq, 1.0, MAX_R) is None


@pytest.mark.gpu
@pytest.mark.parametrize("max_r", [MAX_R, 0], ids=["small-rank-kernel", "norm_gemm"])
@pytest.mark.parametrize(
    ("d_out", "d_in", "r", "w_dtype", "ab_dtype", "transposed", "scaling"),
    [
        (4096, 4096, 16, torch.bfloat16, torch.float32, False, 1.0),
        (14336, 4096, 64, torch.bfloat16, torch.float32, False, 0.5),
        (1024, 4096, 64, torch.bfloat16, torch.bfloat16, False, 1.0),
        (4096, 14336, 16, torch.bfloat16, torch.bfloat16, False, 1.0),
        (14336, 4096, 384, torch.bfloat16, torch.float32, False, 0.5),
        (4096, 14336, 384, torch.bfloat16, torch.bfloat16, False, 2.0),
        (1000, 96, 5, torch.float16, torch.float32, False, 0.25),
        (1024, 768, 8, torch.bfloat16, torch.float32, True, 1.0),
        (1000, 300, 1, torch.bfloat16, torch.float32, False, 1.0),
    ],
)
def test_gpu_norm_scales_gives_the_python_paths_bits(
    ext, monkeypatch, max_r, d_out, d_in, r, w_dtype, ab_dtype, transposed, scaling
):
    if r > MAX_R and max_r == 0:
        pytest.skip("norm_gemm either way: the case above")  # (its plan is filed: the extension keeps it)
    monkeypatch.setattr(norm_small, "MAX_R", max_r)
    torch.manual_seed(d_out + r)
    weight, lora_A, lora_B, magnitude, w_sq = _layer(d_out, d_in, r, w_dtype, ab_dtype, transposed)
    for _ in range(2):  # the first call times the cross term's layouts and compiles; the second launches directly
        norm_py, scales_py = kn.norm_and_scales(weight, lora_A, lora_B, scaling, magnitude, w_sq=w_sq)
    assert ext.norm_scales(weight, lora_A, lora_B, magnitude, w_sq, scaling, max_r) is False  # no plan yet
    if (d_out, d_in, r) == (1024, 4096, 64) and max_r:  # 16 row blocks: the small-rank kernel splits d_in here
        assert norm_small.split(weight)[0] > 1
    assert native_bridge._file_norm_plan(ext, weight, lora_A, lora_B, magnitude)
    _poison()
    with torch.autocast("cuda", dtype=torch.float16):  # the C++ path turns autocast off, as the Python path does
        norm, scales = ext.norm_scales(weight, lora_A, lora_B, magnitude, w_sq, scaling, max_r)
    assert norm.shape == (d_out,) and scales.shape == (3, d_out)
    assert not norm.isnan().any() and not scales.isnan().any()
    torch.testing.assert_close(norm, norm_py, rtol=0, atol=0)
    torch.testing.assert_close(scales, scales_py, rtol=0, atol=0)
    exact = torch.linalg.vector_norm(weight.double() + scaling * lora_B.double() @ lora_A.double(), dim=1)
    torch.testing.assert_close(norm.double(), exact, rtol=2e-3, atol=0)


@pytest.mark.gpu
def test_gpu_norm_scales_declines_what_it_does_not_take_and_gives_up_without_plans(ext):
    weight, lora_A, lora_B, magnitude, w_sq = _layer(64, 32, 4, torch.bfloat16, torch.float32)
    f32 = _layer(64, 32, 4, torch.float32, torch.float32)
    assert ext.norm_scales(*f32[:4], f32[4], 1.0, MAX_R) is None  # float32 weights: the fused float32 kernel's path
    odd = _layer(62, 32, 4, torch.bfloat16, torch.float32)  # the scales row would start unaligned
    assert ext.norm_scales(*odd[:4], odd[4], 1.0, MAX_R) is None
    big = _layer(16 * 2**20 // 64 + 4, 8, 64, torch.bfloat16, torch.float32)  # the cross term in several chunks
    assert ext.norm_scales(*big[:4], big[4], 1.0, MAX_R) is None
    assert ext.norm_scales(weight, lora_A, lora_B, magnitude, w_sq[1:], 1.0, MAX_R) is None  # unaligned w_sq
    got = [ext.norm_scales(weight, lora_A, lora_B, magnitude, w_sq, 1.0, MAX_R) for _ in range(80)]  # never filed here
    assert got[0] is False and got[-1] is None and got.index(None) <= 65


@pytest.mark.gpu
def test_gpu_cache_misses_run_in_cpp_with_the_python_paths_results(ext, monkeypatch):
    """Through the norm cache: the first miss of a shape runs the Python path and files the plan, later misses run
    in C++ (``norm:native``) with the same bits as with ``FLASHDORA_NATIVE=0``."""
    weight, lora_A, lora_B, magnitude, w_sq = _layer(2048, 1024, 32, torch.bfloat16, torch.float32)
    _use(ext, monkeypatch)
    monkeypatch.setenv("FLASHDORA_NATIVE", "0")
    want = ops_norm.fresh(
        weight, lora_A, lora_B, magnitude, 0.5, dispatch.norm_impl(weight, lora_A, lora_B, magnitude), w_sq
    )
    assert dispatch.norm_impl(weight, lora_A, lora_B, magnitude) == "triton"
    monkeypatch.setenv("FLASHDORA_NATIVE", "1")
    assert dispatch.norm_impl(weight, lora_A, lora_B, magnitude) == "native"
    flashdora.reset_stats()
    got = [ops_norm.fresh(weight, lora_A, lora_B, magnitude, 0.5, "native", w_sq) for _ in range(3)]
    assert flashdora.stats().get("norm:native") == 2 and flashdora.stats()["norm:triton"] == 3
    for norm, scales in got:
        torch.testing.assert_close(norm, want[0], rtol=0, atol=0)
        torch.testing.assert_close(scales, want[1], rtol=0, atol=0)
