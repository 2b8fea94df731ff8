"""``launcher.launch``: the direct launch passes every constexpr by name, so a missing one must fail loudly, on the CPU
too (a signature default once passed the interpreter and failed only on the GPU)."""

import pytest
import torch
import triton
import triton.language as tl

from flashdora.kernels import launcher


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
        launcher.launch(_add_kernel, _grid, (10,), (x, 10), dict(ADD=2))
    assert torch.equal(x, torch.arange(10, dtype=torch.float32) + 4)


def test_launch_refuses_a_missing_constexpr():
    x = torch.zeros(10)
    with pytest.raises(TypeError, match=r"_add_kernel needs \['ADD'\]"):
        launcher.launch(_add_kernel, _grid, (11,), (x, 10), {})
    assert torch.equal(x, torch.zeros(10))


def _drop_block_8(candidates, named_args, **kwargs):
    return [c for c in candidates if c.kwargs["BLOCK"] != 8]


@triton.autotune(
    configs=[triton.Config({"BLOCK": 8}, num_warps=1), triton.Config({"BLOCK": 16}, num_warps=1),
             triton.Config({"BLOCK": 32}, num_warps=1)],
    key=["n"], prune_configs_by={"early_config_prune": _drop_block_8},
)  # fmt: skip
@triton.jit
def _fill_block_kernel(p_x, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(p_x + offs, tl.zeros([BLOCK], dtype=tl.float32) + BLOCK, mask=offs < n)


def test_launch_takes_the_first_config_its_pruning_keeps_without_tuning(monkeypatch):
    """By default (``FLASHDORA_AUTOTUNE`` unset) the first launch of a key compiles one config, the first that the
    kernel's own pruning keeps, and never runs the autotuner (a fresh machine would compile every config)."""
    if not launcher.backend.private_apis():
        pytest.skip("the plain launch always tunes")
    monkeypatch.delenv("FLASHDORA_AUTOTUNE", raising=False)

    def no_tuning(*args, **kwargs):
        raise AssertionError("the autotuner ran")

    monkeypatch.setattr(_fill_block_kernel, "run", no_tuning)
    x = torch.full((40,), float("nan"))
    launcher.launch(_fill_block_kernel, _grid, (40,), (x, 40), {})
    assert launcher._TUNED[(id(_fill_block_kernel), (40,))][0]["BLOCK"] == 16
    assert torch.equal(x[:16], torch.full((16,), 16.0)) and x[16:].isnan().all()
    assert launcher.default_config(_fill_block_kernel, (x, 40), {}).kwargs == {"BLOCK": 16}


def test_autotune_switch_runs_the_autotuner(monkeypatch):
    """``FLASHDORA_AUTOTUNE=1``: the first launch of a key goes through the autotuner."""
    monkeypatch.setenv("FLASHDORA_AUTOTUNE", "1")
    calls = []
    run = _add_kernel.run
    monkeypatch.setattr(_add_kernel, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    x = torch.zeros(10)
    launcher.launch(_add_kernel, _grid, (12,), (x, 10), dict(ADD=1))
    assert calls == [1] and torch.equal(x, torch.ones(10))


def test_specialization_tells_apart_what_triton_specializes_on():
    """Calls share a compiled kernel only when Triton would compile the same one: the key must change with pointer
    alignment, divisibility by 16, equality to 1 and the 32-bit range of integers, and with nothing else."""
    buf = torch.zeros(64)
    spec = launcher._specialization
    base = spec((buf, 32, 1.5))
    assert spec((buf[4:], 48, 2.5)) == base  # another aligned pointer, another multiple of 16, another float
    assert spec((buf[1:], 32, 1.5)) != base  # 4-byte offset: not 16-byte aligned
    assert spec((buf, 33, 1.5)) != base
    assert spec((buf, 1, 1.5)) != spec((buf, 3, 1.5))
    assert spec((buf, 2**31, 1.5)) != spec((buf, 2**31 - 16, 1.5))


@pytest.mark.parametrize(
    "args",
    [
        pytest.param((0, 0, 32, 1.5), id="aligned"),
        pytest.param((1, 0, 32, 1.5), id="first-misaligned"),
        pytest.param((0, 3, 33, 2.5), id="second-misaligned"),
        pytest.param((4, 4, 1, 1.5), id="both-misaligned-one"),
        pytest.param((0, 0, 2**31, 1.5), id="int64"),
    ],
)
def test_launch_specialization_tells_apart_what_specialization_does(args):
    """The launch's fast key (pointers in one pass, scalars looked up by value) separates two calls exactly when
    ``_specialization`` does, over pairs of pointer offsets, ints and floats."""
    buf = torch.zeros(64)

    def call(off_x, off_y, n, alpha):
        return (buf[off_x:], buf[off_y:], n, alpha)

    others = [(0, 0, 32, 1.5), (1, 0, 32, 1.5), (0, 3, 33, 2.5), (4, 4, 1, 1.5), (0, 0, 2**31, 1.5), (8, 0, 48, 0.5)]
    a = call(*args)
    for other in others:
        b = call(*other)
        slow = launcher._specialization(a) == launcher._specialization(b)
        assert (launcher._launch_specialization(a, 2) == launcher._launch_specialization(b, 2)) == slow, other


def test_launch_refuses_a_tensor_after_a_scalar():
    x = torch.zeros(10)
    with pytest.raises(TypeError, match="tensor arguments must all come before"):
        launcher._leading_tensors((x, 10, x))


@triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=2)], key=["n"])
@triton.jit
def _axpy_kernel(p_x, p_y, p_out, n, stride, alpha, BLOCK: tl.constexpr):
    """out = alpha x + y over ``n`` elements ``stride`` apart: a float, and an int that is 1 (Triton folds it)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(p_x + offs * stride, mask=mask)
    tl.store(p_out + offs, alpha * x + tl.load(p_y + offs, mask=mask), mask=mask)


def _axpy(x, y, stride, alpha):
    n = y.numel()
    out = torch.full_like(y, float("nan"))
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)  # noqa: E731
    launcher.launch(_axpy_kernel, grid, (n,), (x, y, out, n, stride, alpha), {})
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("stride", [1, 3])
def test_direct_launches_match_tritons_launcher(monkeypatch, stride):
    """After the first call, launches go through torch's C++ launcher where torch has one (``_StaticCudaLauncher``):
    every element written, the same bits as Triton's own launcher (``FLASHDORA_STATIC_LAUNCH=0``), an int equal to 1
    (folded into a constant by Triton) and a float among the arguments, several calls in a row."""
    n = 1000
    x = torch.randn(n * stride, device="cuda")
    y = torch.randn(n, device="cuda")
    ref = 0.75 * x[::stride] + y
    outs = [_axpy(x, y, stride, 0.75) for _ in range(3)]
    code = launcher._specialization((stride,))[0]  # the key's last field: (pointer codes, codes of n, stride, alpha)
    hits = [v for k, v in launcher._COMPILED.items() if k[0][0] == id(_axpy_kernel) and k[-1][1][1] == code]
    assert len(hits) == 1
    if launcher._static_ok():
        assert hits[0][0] is None, "torch's launcher was not taken"
        assert hits[0][7] is None or stride == 1  # only an int Triton folded is left out of the cubin's arguments
    monkeypatch.setenv("FLASHDORA_STATIC_LAUNCH", "0")
    launcher._COMPILED.clear()
    outs += [_axpy(x, y, stride, 0.75) for _ in range(2)]
    for out in outs:
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref)
        assert torch.equal(out, outs[-1])


@triton.jit
def _scale_kernel(p_x, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(p_x + offs, mask=mask)
    tl.store(p_x + offs, (x.to(tl.float32) * FACTOR).to(p_x.dtype.element_ty), mask=mask)


def test_launch_jit_keys_compiled_kernels_by_argument_dtype(device):
    """A plain ``@triton.jit`` kernel through ``launch_jit``: Triton compiles one kernel per pointer dtype, so calls
    with tensors of another dtype in turn must not reuse the first one's (on the GPU, the direct launch)."""
    for _ in range(2):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.arange(10, dtype=torch.float32, device=device).to(dtype)
            launcher.launch_jit(_scale_kernel, (1,), (x, 10), dict(FACTOR=3, BLOCK=16))
            assert torch.equal(x.float(), torch.arange(10, dtype=torch.float32, device=device) * 3), dtype


def test_launch_jit_refuses_a_missing_constexpr(device):
    if not launcher.backend.private_apis():
        pytest.skip("the plain launch")
    x = torch.zeros(10, device=device)
    with pytest.raises(TypeError, match=r"_scale_kernel needs \['BLOCK'\]"):
        launcher.launch_jit(_scale_kernel, (1,), (x, 10), dict(FACTOR=3))
