"""Shared test helpers: the tolerance table, float64 comparisons, input factories and the built C++ extension."""

import pytest
import torch

# Relative error bars (||out - ref|| / ||ref|| against float64), the same on the GPU and under the interpreter: the
# Triton 3.9 interpreter truncates fp32->bf16 stores, so the kernels round to nearest by hand there (EMULATE_RNE).
RTOL = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, computed in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().flatten(), ref.double().flatten()
    return (out @ ref / (out.norm() * ref.norm()).clamp_min(1e-300)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float, what: str = "output") -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = rel_err(out, ref)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN in place (for outputs a kernel must overwrite)."""
    return t.fill_(float("nan"))


def dora_inputs(d_in, d_out, r, lead=(2, 3), dtype=torch.float32, device="cpu", bias=True, g_near_one=False):
    """Fresh random DoRA layer inputs; ``g_near_one`` puts magnitudes within 1e-3 of the row norms."""
    x = torch.randn(*lead, d_in, device=device, dtype=dtype)
    weight = torch.randn(d_out, d_in, device=device, dtype=dtype) / d_in**0.5
    b = torch.randn(d_out, device=device, dtype=dtype) if bias else None
    lora_A = torch.randn(r, d_in, device=device, dtype=dtype) / d_in**0.5
    lora_B = torch.randn(d_out, r, device=device, dtype=dtype) / r**0.5
    scaling = 0.7
    norm = (weight.double() + scaling * lora_B.double() @ lora_A.double()).norm(dim=1)
    if g_near_one:
        magnitude = (norm * (1 + 1e-3 * (2 * torch.rand_like(norm) - 1))).float()
    else:
        magnitude = (norm * (0.5 + torch.rand_like(norm))).float()
    return dict(x=x, weight=weight, bias=b, lora_A=lora_A, lora_B=lora_B, magnitude=magnitude, scaling=scaling)


def backward_order(y: torch.Tensor) -> list[str]:
    """Runs ``y``'s backward and says in what order the compose node's first two inputs ran: each node of the base
    layer's chain (``base``, down to the input's leaf) and the LoRA A matmul's node (``a``), from prehooks."""
    base, a = (y.grad_fn.next_functions[i][0] for i in (0, 1))
    order = []
    node = base
    while node is not None and type(node).__name__ != "AccumulateGrad":
        node.register_prehook(lambda grads: order.append("base"))
        node = next((f for f, _ in node.next_functions if f is not None and "AccumulateGrad" not in type(f).__name__),
                    None)  # fmt: skip
    a.register_prehook(lambda grads: order.append("a"))
    y.backward(torch.randn_like(y))
    return order


def native_extension():
    """flashdora's C++ extension, built (or loaded from torch's extension cache) now and not in use (a test that
    wants it in use sets ``native.build._module``); skips the test where it cannot be built."""
    from flashdora import native

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHDORA_NATIVE", "1")
        native.reset()
        mod = native.load()
    native.reset()
    if mod is None:
        pytest.skip("the C++ extension cannot be built here (no compiler?)")
    return mod
