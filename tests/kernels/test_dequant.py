"""The 8-bit dequantization kernel against bitsandbytes' arithmetic in torch (interpreter on CPU; real shapes under
``gpu``)."""

import pytest
import torch

from flashdora.kernels import dequant
from flashdora.quant.dequant import _INT8_SCALE


def _int8(d_out, d_in, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(-127, 128, (d_out, d_in), generator=g, dtype=torch.int8).to(device)
    scb = (torch.rand(d_out, generator=g) * 3 + 0.01).to(device)  # float32 row absmax, as Int8Params keeps it
    return data, scb


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "d_out, d_in",
    [
        pytest.param(1, 1, id="1x1"),
        pytest.param(9, 70, id="9x70"),
        pytest.param(33, 17, id="33x17"),
        pytest.param(256, 300, id="256x300"),  # enough elements that a reordered product changes some roundings
        pytest.param(14336, 4096, id="14336x4096", marks=pytest.mark.gpu),
        pytest.param(1001, 515, id="1001x515", marks=pytest.mark.gpu),
    ],
)
def test_int8_to_gives_the_bits_of_the_float32_dequantization_cast(d_out, d_in, dtype, device, poisoned_empty):
    """``CB * SCB * (1/127)`` in float32, in that order, then one rounding: the cast of bitsandbytes'
    ``int8_vectorwise_dequant`` result, bit for bit, on shapes that cut the tiles at both edges."""
    data, scb = _int8(d_out, d_in, device)
    assert dequant.takes(data, scb, dtype)
    ref = (data * scb.view(-1, 1) * _INT8_SCALE).to(dtype)
    out = dequant.int8_to(data, scb, dtype, _INT8_SCALE)
    assert out.dtype == dtype and out.shape == (d_out, d_in)
    assert torch.equal(out, ref)


def test_takes_only_what_the_kernel_reads():
    """A 16-bit output of a contiguous 2-D int8 weight with one float32 scale per row on its device; else the row
    chunks in ``quant.dequant._dequantize_int8`` run."""
    data, scb = _int8(8, 6, "cpu")
    assert dequant.takes(data, scb, torch.bfloat16)
    assert not dequant.takes(data, scb, torch.float32)  # float32: bitsandbytes' own expression, no rounding
    assert not dequant.takes(data.t(), scb, torch.bfloat16)  # not contiguous
    assert not dequant.takes(data.float(), scb, torch.bfloat16)
    assert not dequant.takes(data, scb[:-1], torch.bfloat16)
    assert not dequant.takes(data, scb.double(), torch.bfloat16)
    assert not dequant.takes(data[0], scb[:1], torch.bfloat16)  # 1-D
