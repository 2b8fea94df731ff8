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


def test_specialization_tells_apart_what_triton_specializes_on():
    """Calls share a compiled kernel only when Triton would compile the same one: the key must change with pointer
    alignment, divisibility by 16, equality to 1 and the 32-bit range of integers, and with nothing else."""
    buf = torch.zeros(64)
    spec = configs._specialization
    base = spec((buf, 32, 1.5))
    assert spec((buf[4:], 48, 2.5)) == base  # another aligned pointer, another multiple of 16, another float
    assert spec((buf[1:], 32, 1.5)) != base  # 4-byte offset: not 16-byte aligned
    assert spec((buf, 33, 1.5)) != base
    assert spec((buf, 1, 1.5)) != spec((buf, 3, 1.5))
    assert spec((buf, 2**31, 1.5)) != spec((buf, 2**31 - 16, 1.5))
