import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashdora import factored_norm, stats
from flashdora.ops.norm import norm_sq_eager
from flashdora.reference import row_norm_ref
from tests.helpers import RTOL, assert_close, dora_inputs

SHAPES = [
    pytest.param(64, 48, 8, id="64x48-r8"),
    pytest.param(37, 1, 5, id="1row"),
    pytest.param(33, 29, 1, id="odd-r1"),
    pytest.param(12, 20, 16, id="r>d_in"),
]


def _ref(i):
    return row_norm_ref(i["weight"].double(), i["lora_A"].double(), i["lora_B"].double(), i["scaling"])


@pytest.mark.parametrize("d_in, d_out, r", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_factored_norm_matches_float64(d_in, d_out, r, dtype, chunk_size, monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(d_in, d_out, r, dtype=dtype)
    out = factored_norm(i["weight"], i["lora_A"], i["lora_B"], i["scaling"], chunk_size=chunk_size)
    assert out.dtype == torch.float32 and out.shape == (d_out,)
    assert not out.requires_grad
    # The only rounding is the 16-bit GEMM of W with lora_A cast to W's dtype: far below bf16's output tolerance.
    assert_close(out, _ref(i), 1e-5 if dtype == torch.float32 else 1e-3, "norm")


def test_factored_norm_bf16_weight_with_fp32_adapters(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(96, 40, 16)
    w = i["weight"].bfloat16()
    out = factored_norm(w, i["lora_A"], i["lora_B"], i["scaling"])
    ref = row_norm_ref(w.double(), i["lora_A"].double(), i["lora_B"].double(), i["scaling"])
    assert_close(out, ref, 1e-3, "norm")


def test_factored_norm_transposed_weight_view(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(24, 18, 4)
    w_t = i["weight"].T.contiguous().T  # [d_out, d_in] with column-major strides, as Conv1D gives
    assert not w_t.is_contiguous()
    out = factored_norm(w_t, i["lora_A"], i["lora_B"], i["scaling"], chunk_size=5)
    assert_close(out, _ref(i), RTOL[torch.float32], "norm")


class _LargestOutput(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # views and detach allocate nothing
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("d_in, d_out, r, chunk", [(64, 96, 8, 8), (16, 40, 24, 3)], ids=["r<d_in", "r>d_in"])
def test_no_intermediate_larger_than_a_chunk(d_in, d_out, r, chunk, monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(d_in, d_out, r)
    dense = d_out * d_in
    with _LargestOutput() as mode:
        factored_norm(i["weight"], i["lora_A"], i["lora_B"], i["scaling"], chunk_size=chunk)
    bound = max(chunk * max(d_in, r), r * d_in, d_out)
    assert mode.largest <= bound < dense, (mode.largest, bound, dense)


def test_zero_row_gives_zero_not_nan(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(16, 6, 4)
    i["weight"][2] = 0
    i["lora_B"][2] = 0
    out = factored_norm(i["weight"], i["lora_A"], i["lora_B"], i["scaling"])
    assert out[2] == 0 and torch.isfinite(out).all()


def test_negative_round_off_is_clamped():
    # W = -s B A exactly in float64 terms: the factored sum is ~0 and may round below zero.
    a = torch.randn(4, 32)
    b = torch.randn(8, 4)
    w = -(b @ a)
    sq = norm_sq_eager(w, a, b, 1.0)
    out = factored_norm(w, a, b, 1.0)
    assert torch.isfinite(out).all() and (out >= 0).all()
    assert out.max() <= 1e-2 * w.norm(dim=1).max(), (sq, out)


def test_norm_counts_its_path(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(8, 4, 2)
    before = stats().get("norm:eager", 0)
    factored_norm(i["weight"], i["lora_A"], i["lora_B"], i["scaling"])
    assert stats()["norm:eager"] == before + 1


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(lora_A=torch.randn(4, 9)), ValueError, r"lora_A expected shape \[4, 8\]"),
        (dict(lora_B=torch.randn(6, 3)), ValueError, r"lora_B expected shape \[d_out, r\] = \[6, 4\]"),
        (dict(weight=torch.randn(6)), ValueError, "weight expected 2 dimensions"),
        (dict(weight=torch.ones(6, 8, dtype=torch.int32)), TypeError, "weight expected a floating dtype"),
        (dict(lora_A=[[1.0]]), TypeError, "lora_A expected a torch.Tensor"),
        (dict(scaling=float("nan")), ValueError, "scaling expected a finite number, got nan"),
        (dict(scaling=10**400), ValueError, "scaling expected a finite number, got one beyond float's range"),
        (dict(scaling="2"), TypeError, "scaling expected a real number"),
        (dict(chunk_size=0), ValueError, "chunk_size expected a positive integer"),
        (dict(lora_A=torch.randn(4, 8, device="meta")), ValueError, "lora_A expected device cpu"),
    ],
)
def test_named_errors(change, error, match):
    args = dict(weight=torch.randn(6, 8), lora_A=torch.randn(4, 8), lora_B=torch.randn(6, 4), scaling=0.5)
    args.update(change)
    with pytest.raises(error, match=f"factored_norm: .*{match}" if not match.startswith("factored") else match):
        factored_norm(**args)


@pytest.mark.parametrize("d_in, d_out, r", SHAPES)
def test_inputs_are_not_mutated(d_in, d_out, r, monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    i = dora_inputs(d_in, d_out, r)
    saved = {k: i[k].clone() for k in ("weight", "lora_A", "lora_B")}
    factored_norm(i["weight"], i["lora_A"], i["lora_B"], i["scaling"], chunk_size=3)
    for k, v in saved.items():
        assert torch.equal(i[k], v), k


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_autocast_does_not_reach_the_norm(backend, monkeypatch):
    """The norm is float32 math whatever autocast the caller runs under: bf16 autocast once put the eager path's
    ``A A^T`` and ``B (A A^T)`` in bf16 (2e-4 relative error against 4e-8)."""
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    torch.manual_seed(0)
    weight, lora_A, lora_B = torch.randn(64, 512), torch.randn(64, 512) * 0.1, torch.randn(64, 64)
    ref = row_norm_ref(weight.double(), lora_A.double(), lora_B.double(), 2.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = factored_norm(weight, lora_A, lora_B, 2.0)
    assert out.dtype == torch.float32
    assert_close(out, ref, RTOL[torch.float32], "norm")
