"""The norm's cross term from a bitsandbytes 4-bit weight's bytes (``kernels/quant.py``) against bitsandbytes' own
dequantization, and the QDoRA norm cache reading the bytes instead of a dense weight."""

import pytest
import torch

from flashdora.kernels import configs

bnb = pytest.importorskip("bitsandbytes")

# fp32 -> bf16 in the Triton interpreter truncates where the GPU rounds (one bf16 ulp on some elements of W):
# interpreter bf16 runs compare at that ulp's size; fp16 converts exactly there, and on the GPU W is bitsandbytes' W.
W_TOL = {torch.float16: 0.0, torch.bfloat16: 2**-7 if configs.INTERPRETED else 0.0}


def _layer(d_out, d_in, quant_type, nested, blocksize, dtype, device):
    weight = (torch.randn(d_out, d_in) / d_in**0.5).to(dtype)
    layer = bnb.nn.Linear4bit(d_in, d_out, bias=False, compute_dtype=dtype, quant_type=quant_type,
                              compress_statistics=nested, device="meta")  # fmt: skip
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=quant_type, blocksize=blocksize,
                                     compress_statistics=nested)  # fmt: skip
    layer = layer.to(device)  # (bitsandbytes quantizes on the move)
    layer.support_avx512bf16_for_cpu = False
    return layer


def _dense(layer):
    return bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)


CASES = [  # (d_out, d_in, r, quant type, double quantization, blocksize, dtype)
    pytest.param(40, 256, 20, "nf4", False, 64, torch.bfloat16, id="nf4-bf16"),
    pytest.param(40, 256, 20, "fp4", False, 64, torch.bfloat16, id="fp4-bf16"),
    pytest.param(40, 256, 20, "nf4", True, 64, torch.bfloat16, id="nf4-dq-bf16"),
    pytest.param(33, 256, 17, "fp4", True, 128, torch.float16, id="fp4-dq-b128-fp16"),
    pytest.param(33, 128, 5, "nf4", True, 32, torch.float16, id="nf4-dq-b32-fp16"),
    pytest.param(33, 256, 17, "nf4", True, 128, torch.float16, id="nf4-dq-b128-fp16"),
    pytest.param(24, 128, 140, "nf4", False, 64, torch.bfloat16, id="nf4-r140-two-column-blocks"),
    pytest.param(4096, 4096, 64, "nf4", True, 64, torch.bfloat16, id="4096-r64-nf4-dq", marks=pytest.mark.gpu),
    pytest.param(14336, 4096, 384, "nf4", False, 64, torch.bfloat16, id="14336-r384-nf4", marks=pytest.mark.gpu),
    pytest.param(4096, 14336, 16, "nf4", True, 64, torch.float16, id="4096x14336-r16-nf4-dq", marks=pytest.mark.gpu),
    pytest.param(4096, 4096, 64, "fp4", True, 64, torch.bfloat16, id="4096-r64-fp4-dq", marks=pytest.mark.gpu),
    pytest.param(4096, 4096, 128, "fp4", False, 64, torch.float16, id="4096-r128-fp4-fp16", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("d_out, d_in, r, quant_type, nested, blocksize, dtype", CASES)
def test_cross_term_matches_bitsandbytes_dequantization(
    d_out, d_in, r, quant_type, nested, blocksize, dtype, device, poisoned_empty
):  # fmt: skip
    from flashdora.kernels.quant import packed_4bit

    layer = _layer(d_out, d_in, quant_type, nested, blocksize, dtype, device)
    packed = packed_4bit(layer)
    assert packed is not None and packed.shape == (d_out, d_in) and packed.dtype == dtype
    dense = _dense(layer)
    # One-hot rows of a pick columns of W: C holds W's elements themselves (one exact product each), so W must be
    # the one bitsandbytes dequantizes, element for element.
    cols = torch.randint(0, d_in, (r,), device=device)
    a = torch.zeros(r, d_in, device=device, dtype=dtype)
    a[torch.arange(r, device=device), cols] = 1
    got, stride_rows, stride_r = packed.cross_term(a, 0, d_out)
    assert got.shape == (d_out, r) and got.dtype == torch.float32 and (stride_rows, stride_r) == (r, 1)
    want = dense[:, cols].float()
    assert ((got - want).abs() <= W_TOL[dtype] * want.abs()).all()
    # A dense a: the GEMM against a float64 product of the same W, whole and a chunk of rows.
    a = (torch.randn(r, d_in, device=device) / d_in**0.5).to(dtype)
    want = (dense.double() @ a.double().T).float()
    for row0, rows in [(0, d_out), (d_out // 3, d_out - d_out // 3)]:
        got, _, _ = packed.cross_term(a, row0, rows)
        assert torch.isfinite(got).all()
        err = (got - want[row0 : row0 + rows]).abs().max() / want.abs().max()
        assert err <= (1e-2 if W_TOL[dtype] else 1e-4), (row0, err)  # (float32 sums over up to 14336 terms)


def test_packed_declines_what_it_does_not_cover():
    """Layers the kernel does not read take the dequantized path: float32 dequantized dtype, rows that cross
    quantization blocks, a Linear that is not 4-bit."""
    from flashdora.kernels.quant import packed_4bit

    assert packed_4bit(_layer(8, 64, "nf4", False, 64, torch.bfloat16, "cpu")) is not None
    assert packed_4bit(_layer(8, 64, "fp4", False, 64, torch.bfloat16, "cpu")) is not None
    assert packed_4bit(_layer(8, 64, "nf4", False, 64, torch.float32, "cpu")) is None
    assert packed_4bit(_layer(8, 96, "nf4", False, 64, torch.bfloat16, "cpu")) is None  # 96 % 64: blocks cross rows
    assert packed_4bit(torch.nn.Linear(64, 8)) is None


@pytest.mark.parametrize("nested", [False, True])
def test_dequantized_is_pefts_dequantization(nested):
    """``layers.dequantized`` calls bitsandbytes directly for 4-bit weights: the same tensor PEFT's
    ``dequantize_module_weight`` gives (and so the weight the layer's forward uses)."""
    from peft.utils.integrations import dequantize_module_weight

    from flashdora.layers import dequantized

    layer = _layer(8, 128, "nf4", nested, 64, torch.bfloat16, "cpu")
    got, want = dequantized(layer), dequantize_module_weight(layer)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
