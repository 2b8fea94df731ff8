"""``configs.launch``: the direct launch passes every constexpr by name, so a missing one must fail loudly, on the CPU
too (a signature default once passed the interpreter and failed only on the GPU)."""

import pytest
import torch
import triton
import triton.language as tl

from flashdora.kernels import configs


@triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=1)], key=["n"])
@triton.jit
def _add_kernel(p_x, n, ADD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(p_x + offs, tl.load(p_x + offs, mask=mask) + ADD, mask=mask)


def _grid(meta):
    return (1,)


def test_launch_passes_flags_by_name():
    x = torch.arange(10, dtype=torch.float32)
    for _ in range(2):  # the first call tunes, the second takes the direct path (on the GPU)
        configs.launch(_add_kernel, _grid, (10,), (x, 10), dict(ADD=2))
    assert torch.equal(x, torch.arange(10, dtype=torch.float32) + 4)


def test_launch_refuses_a_missing_constexpr():
    x = torch.zeros(10)
    with pytest.raises(TypeError, match=r"_add_kernel needs \['ADD'\]"):
        configs.launch(_add_kernel, _grid, (11,), (x, 10), {})
    assert torch.equal(x, torch.zeros(10))
