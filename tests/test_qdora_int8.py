"""QDoRA on bitsandbytes 8-bit bases (``Linear8bitLt``), which bitsandbytes' CPU backend runs here."""

import copy

import pytest
import torch

import flashdora
from tests.helpers import rel_err
from tests.peft_models import (
    make_ids,
    train_step,
    unpatched,  # noqa: F401 (fixture)
)
from tests.qdora_models import int8_bf16_model, qdora_model

bnb = pytest.importorskip("bitsandbytes")


def test_qdora_int8_on_the_cpu_matches_peft():
    """``Linear8bitLt`` on bitsandbytes' CPU backend: a training step's logits and gradients as PEFT's own QDoRA
    computes them; flashdora ran every layer. (One step only: on the CPU, PEFT's dequantization re-assigns the int8
    weight, after which bitsandbytes' next forward finds no scales, with PEFT's QDoRA alone too.)"""
    model = qdora_model("int8")
    twin = copy.deepcopy(model)
    flashdora.enable(model)
    flashdora.reset_stats()
    ids = make_ids(256)
    _, logits, grads = train_step(model, ids)
    _, ref_logits, ref_grads = train_step(twin, ids)
    assert rel_err(logits, ref_logits) <= 1e-5  # (on the CPU bitsandbytes' int8 matmul returns float32)
    assert grads.keys() == ref_grads.keys() and any("magnitude" in k for k in grads)
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) <= 1e-4, name
    stats = flashdora.stats()
    assert not any(k.startswith("peft_fallback") for k in stats), stats
    assert stats.get("norm:eager", 0) > 0


def _int8_layer(d_out=40, d_in=24, seed=0, device="cpu"):
    torch.manual_seed(seed)
    layer = bnb.nn.Linear8bitLt(d_in, d_out, bias=False, has_fp16_weights=False)
    layer.weight = bnb.nn.Int8Params(torch.randn(d_out, d_in) * 0.05, requires_grad=False, has_fp16_weights=False)
    return layer.to(device)  # (quantizes)


def _float32_numels(fn):
    """``fn()``, and the element counts of the float32 tensors its ops made (a 0 first)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    numels = [0]

    class Float32Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
                numels.append(out.numel())
            return out

    with Float32Outputs():
        return fn(), numels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_int8_dequantization_is_bitsandbytes_cast_a_chunk_at_a_time(dtype, monkeypatch):
    """An 8-bit weight dequantizes to bitsandbytes' ``int8_vectorwise_dequant`` (PEFT's float32 weight) cast to the
    requested dtype, bit for bit, row chunk by row chunk: in a 16-bit dtype no float32 tensor larger than a chunk
    exists. The layer keeps its weight and scales (PEFT's CPU path re-assigns the weight)."""
    from flashdora.quant import dequant as bnb_dequant

    layer = _int8_layer()
    weight, scb = layer.weight, layer.weight.SCB
    want = bnb.functional.int8_vectorwise_dequant(weight.data, scb).to(dtype)
    monkeypatch.setattr(bnb_dequant, "_INT8_CHUNK", 7 * 24)  # 7 rows a chunk: 6 chunks, the last one short

    got, numels = _float32_numels(lambda: bnb_dequant.dequantized(layer, dtype=dtype))
    assert got.dtype == dtype and torch.equal(got, want)
    assert layer.weight is weight and layer.weight.SCB is scb and layer.weight.dtype == torch.int8
    if dtype != torch.float32:
        assert 0 < max(numels) <= 7 * 24 < 40 * 24


def test_qdora_int8_bf16_trains_with_a_bf16_norm_once_per_layer(monkeypatch):
    """bf16 activations on an int8 base: over several optimizer steps the miss dequantizes each weight to bf16 (never
    a float32 ``[d_out, d_in]`` weight), ``||W||^2`` once per layer, and training goes on past the first step (PEFT's
    QDoRA stops there on the CPU); the trained model's output is its uncached recomputation's."""
    from flashdora.ops import norm as norm_ops
    from flashdora.ops import norm_cache

    model = int8_bf16_model()
    flashdora.enable(model)
    flashdora.reset_stats()
    dtypes = []
    real = norm_ops.weight_sq
    monkeypatch.setattr(norm_cache, "weight_sq", lambda w, triton: dtypes.append(w.dtype) or real(w, triton))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    steps = 3
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # (without it PEFT casts the input to the fp32 adapters')
            _, logits, _ = train_step(model, make_ids(256, step))
        assert logits.isfinite().all()
        opt.step()
    n_layers = sum(isinstance(m, bnb.nn.Linear8bitLt) for m in model.modules())
    assert len(dtypes) == n_layers and set(dtypes) == {torch.bfloat16}
    stats = flashdora.stats()
    assert stats["norm:eager"] == n_layers * steps and not any(k.startswith("peft_fallback") for k in stats)
    model.eval()
    ids = make_ids(256, 9)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(input_ids=ids).logits
        flashdora.invalidate()
        assert torch.equal(model(input_ids=ids).logits, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "shape",
    [
        (40, 24),
        (9, 70),
        pytest.param((14336, 4096), marks=pytest.mark.gpu),
        pytest.param((1000, 300), marks=pytest.mark.gpu),
    ],
    ids=["40x24", "9x70", "14336x4096", "1000x300"],
)
def test_int8_dequantization_on_the_triton_path_is_one_kernel_with_the_same_bits(
    dtype, shape, device, monkeypatch, poisoned_empty
):
    """On the Triton path an 8-bit weight dequantizes to a 16-bit dtype in one kernel (tiles cut by both edges),
    bitsandbytes' float32 values cast, bit for bit, and no float32 tensor larger than the row scales is made on the
    way (the interpreter copies its arguments)."""
    from flashdora.kernels import dequant
    from flashdora.quant import dequant as bnb_dequant

    monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    layer = _int8_layer(*shape, device=device)
    want = bnb.functional.int8_vectorwise_dequant(layer.weight.data, layer.weight.SCB).to(dtype)
    launches = []
    real = dequant.int8_to
    monkeypatch.setattr(dequant, "int8_to", lambda *a: launches.append(a[2]) or real(*a))

    got, numels = _float32_numels(lambda: bnb_dequant.dequantized(layer, dtype=dtype))
    assert launches == [dtype] and max(numels) <= shape[0]
    assert got.dtype == dtype and torch.equal(got, want)
