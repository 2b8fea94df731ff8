"""QDoRA: DoRA on bitsandbytes 4-bit and 8-bit bases (bitsandbytes' CPU backend runs them here)."""

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
from tests.qdora_models import bf16_model, count_dequantizations, int8_bf16_model, qdora_model

bnb = pytest.importorskip("bitsandbytes")

KINDS = [
    pytest.param("nf4", "cpu", id="nf4"),
    pytest.param("fp4", "cpu", id="fp4"),
    pytest.param("nf4-dq", "cpu", id="nf4-dq"),
    pytest.param("nf4", "cuda", id="nf4-cuda", marks=pytest.mark.gpu),
    pytest.param("int8", "cuda", id="int8-cuda", marks=pytest.mark.gpu),  # (CPU: a test of its own)
]


@pytest.mark.parametrize("kind, device", KINDS)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_qdora_matches_peft(kind, device, dropout):
    """Eval logits and a training step's gradients (dropout masks alike) as PEFT's own QDoRA computes them, fp32
    compute; flashdora ran every layer (no fallback)."""
    model = qdora_model(kind, dropout=dropout, device=device)
    # int8: bitsandbytes' matmul returns fp16, and PEFT composes in it, flashdora in float32 (~5e-4 apart)
    tol_out, tol_grad = (2e-3, 1e-2) if kind == "int8" else (1e-5, 1e-4)
    twin = copy.deepcopy(model)
    flashdora.enable(model)
    flashdora.reset_stats()
    ids = make_ids(256).to(device)
    model.eval()
    twin.eval()
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, twin(input_ids=ids).logits) <= tol_out
    _, logits, grads = train_step(model, ids)
    _, ref_logits, ref_grads = train_step(twin, ids)
    assert rel_err(logits, ref_logits) <= tol_out
    assert grads.keys() == ref_grads.keys() and any("magnitude" in k for k in grads)
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) <= tol_grad, name
    stats = flashdora.stats()
    assert not any(k.startswith("peft_fallback") for k in stats), stats
    assert stats.get("norm:eager", 0) + stats.get("norm:triton", 0) > 0


def test_qdora_bf16_compute_within_peft_error():
    """bf16 compute: flashdora's error against a float32-compute reference is no larger than PEFT's own."""
    ids = make_ids(256)
    outs = {}
    for name, dtype, enabled in [("ref", torch.float32, False), ("peft", torch.bfloat16, False),
                                 ("flash", torch.bfloat16, True)]:  # fmt: skip
        model = qdora_model("nf4", compute_dtype=dtype)
        if enabled:
            flashdora.enable(model)
        model.eval()
        with torch.no_grad():
            outs[name] = model(input_ids=ids).logits.float()
    assert rel_err(outs["flash"], outs["ref"]) <= 1.5 * rel_err(outs["peft"], outs["ref"]) + 1e-6


def test_qdora_base_norm_once_and_no_float32_dense_weight(monkeypatch):
    """Over several optimizer steps the frozen quantized base's ``||W||^2`` is computed once per layer, and the
    norm dequantizes the weight only in its compute dtype (bf16 here): never a float32 ``[d_out, d_in]`` weight."""
    from flashdora.ops import norm as norm_ops
    from flashdora.ops import norm_cache

    model = bf16_model()
    flashdora.enable(model)
    calls, shapes = [], []
    real = norm_ops.weight_sq

    def counting(weight, triton):
        calls.append(weight.shape)
        shapes.append(weight.dtype)
        return real(weight, triton)

    monkeypatch.setattr(norm_cache, "weight_sq", counting)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(3):
        train_step(model, make_ids(256, step))
        opt.step()
    n_layers = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert len(calls) == n_layers  # once per layer, not once per step
    assert set(shapes) == {torch.bfloat16}


def test_qdora_in_place_write_to_the_packed_weight_is_seen():
    """flashdora reads a packed weight's key through a plain alias (``detach``: Params4bit's ``__torch_function__`` is
    slow); an in-place write into the packed parameter must still move that key, so the norm is recomputed."""
    model = qdora_model()
    flashdora.enable(model)
    model.eval()
    ids = make_ids(256)
    with torch.no_grad():
        model(input_ids=ids)  # fills the cache
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        packed = layer.base_layer.weight
        packed.copy_(packed.flip(0))  # other rows: another W (and its norm) under the same parameter
        got = model(input_ids=ids).logits
    reference = copy.deepcopy(model)
    flashdora.disable(reference)
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    assert rel_err(got, want) < 1e-5


def test_qdora_triton_miss_dequantizes_once_and_matches_eager(monkeypatch):
    """On the Triton path a 4-bit layer's cache miss dequantizes its weight once (for ``||W||^2`` and the cross term
    together) and never on a hit: over several optimizer steps, once per layer and step; the trained model's output
    is the eager path's (same weights)."""
    monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    model = bf16_model(small=True)  # (the count per layer and step needs no size)
    flashdora.enable(model)
    flashdora.reset_stats()
    calls = count_dequantizations(monkeypatch)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    steps = 3
    for step in range(steps):
        train_step(model, make_ids(256, step))
        opt.step()
    n_layers = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert len(calls) == n_layers * steps
    stats = flashdora.stats()
    assert stats["norm:triton"] == n_layers * steps and not any(k.startswith("peft_fallback") for k in stats)
    model.eval()
    ids = make_ids(256, 9)
    with torch.no_grad():
        got = model(input_ids=ids).logits.float()
        assert len(calls) == n_layers * (steps + 1)  # the optimizer's last step: one more miss per layer
        got_again = model(input_ids=ids).logits.float()
        assert len(calls) == n_layers * (steps + 1)  # cached
        monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
        flashdora.invalidate()
        want = model(input_ids=ids).logits.float()
    assert torch.equal(got, got_again)
    assert rel_err(got, want) <= 1e-2  # (the interpreter's bf16 truncation)


DEQUANT_KINDS = [
    pytest.param(kind, dtype, id=f"{kind}-{str(dtype)[6:]}")
    for kind in ("nf4", "fp4", "nf4-dq", "fp4-dq")
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
]


@pytest.mark.gpu
@pytest.mark.parametrize("kind, dtype", DEQUANT_KINDS)
def test_native_dequantize_4bit_is_bitsandbytes_bit_for_bit(kind, dtype, monkeypatch):
    """On CUDA a 4-bit miss dequantizes with bitsandbytes' own kernels from C++: the same bits as
    ``bitsandbytes.functional.dequantize_4bit``, nf4 and fp4, with and without double quantization, for every
    compute dtype, without calling that Python function."""
    from flashdora import native
    from flashdora.native import bridge
    from flashdora.quant import dequant as bnb_dequant

    assert native.load() is not None
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(192, 320, bias=False, quant_type=kind[:3], compress_statistics=kind.endswith("-dq"))
    layer.weight = bnb.nn.Params4bit(torch.randn(320, 192) * 0.05, requires_grad=False, quant_type=kind[:3],
                                     compress_statistics=kind.endswith("-dq"))  # fmt: skip
    layer = layer.cuda()
    layer.weight.quant_state.dtype = dtype
    want = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    assert want.dtype == dtype and want.shape == (320, 192)

    def python_path(*args, **kwargs):
        raise AssertionError("bitsandbytes.functional.dequantize_4bit ran")

    monkeypatch.setattr(bnb.functional, "dequantize_4bit", python_path)
    got = bnb_dequant.dequantized(layer, fast=bridge)
    got_alias = bnb_dequant.dequantized(layer, layer.weight.detach(), fast=bridge)
    assert torch.equal(got, want) and torch.equal(got_alias, want) and got.data_ptr() != want.data_ptr()
    bridge.bnb_kernel.cache_clear()
    monkeypatch.setattr(bnb, "__version__", "0.49.0")  # a version the C++ path was not tested with
    try:
        assert bridge.bnb_kernel(f"cdequantize_blockwise_{bridge._DTYPE_NAMES[dtype]}_{kind[:3]}") == 0
        with pytest.raises(AssertionError, match="dequantize_4bit ran"):
            bnb_dequant.dequantized(layer, fast=bridge)
    finally:
        bridge.bnb_kernel.cache_clear()


def test_dequantize_takes_bitsandbytes_python_function_off_cuda(monkeypatch):
    """Off CUDA a 4-bit weight is dequantized by ``bitsandbytes.functional.dequantize_4bit`` itself, once a call."""
    from flashdora.quant import dequant as bnb_dequant

    layer = qdora_model("nf4").base_model.model.model.layers[0].self_attn.q_proj.base_layer
    calls = []
    real = bnb.functional.dequantize_4bit
    monkeypatch.setattr(bnb.functional, "dequantize_4bit", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = bnb_dequant.dequantized(layer)
    assert calls == [1] and torch.equal(got, real(layer.weight.data, layer.weight.quant_state))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qdora_miss_allocates_no_float32_weight_on_the_triton_path(kind, monkeypatch):
    """A bf16 layer's norm-cache misses on the Triton path (the GPU's; the interpreter here) allocate no float32
    tensor the size of a base weight (PEFT's QDoRA forms several) and nothing larger than the largest 16-bit weight
    the layers' own forwards dequantize; an 8-bit weight's float32 values come a row chunk at a time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashdora.ops import norm_cache
    from flashdora.quant import dequant as bnb_dequant

    monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    monkeypatch.setattr(bnb_dequant, "_INT8_CHUNK", 5 * 64)  # at most 5 rows of the widest weight a chunk
    model = bf16_model(small=True) if kind == "nf4" else int8_bf16_model(small=True)
    flashdora.enable(model)
    bases = [m for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]
    smallest = min(m.in_features * m.out_features for m in bases)
    largest_16bit = 2 * max(m.in_features * m.out_features for m in bases)

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []  # (dtype, numel, bytes) of every tensor an op allocates

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not any(r.alias_info is not None for r in func._schema.returns):  # views allocate nothing
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        self.seen.append((t.dtype, t.numel(), t.numel() * t.element_size()))
            return out

    mode = Outputs()
    real = norm_cache.NormCache.lookup_owner.__func__

    def watched(cls, *args, **kwargs):
        with mode:
            return real(cls, *args, **kwargs)

    monkeypatch.setattr(norm_cache.NormCache, "lookup_owner", classmethod(watched))
    flashdora.reset_stats()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "int8"):
        train_step(model, make_ids(256))
    assert flashdora.stats()["norm:triton"] == len(bases)
    float32 = [n for dtype, n, _ in mode.seen if dtype == torch.float32]
    assert float32 and max(float32) < smallest, (max(float32), smallest)
    assert max(b for *_, b in mode.seen) <= largest_16bit
