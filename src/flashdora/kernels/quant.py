"""The norm's cross term ``W A^T`` straight from a bitsandbytes 4-bit weight (nf4 or fp4, with or without double
quantization), dequantized tile by tile in registers: no dense copy of ``W`` is written, and a cache miss on a
QDoRA layer is one Triton launch where dequantizing first took bitsandbytes' two ops (and their Python) plus a GEMM.

Each tile of ``W`` is rebuilt as bitsandbytes' own dequantization computes it: ``code[nibble] * absmax`` in
float32, rounded to the weight's 16-bit dtype (the first element of a byte in its high nibble), with a double-quantized
``absmax`` rebuilt as ``code2[absmax_u8] * absmax2 + offset``. Elements of a byte are columns ``2h`` and ``2h + 1``
of a row, so the tile's product is two GEMMs: the high nibbles against ``A``'s even columns and the low ones against
its odd columns. Layers this file does not cover (8-bit, other storage, float32 ``W``) take the dequantized path
(``layers.dequantized``). Used by ``kernels/norm_gemm.py``; tested against bitsandbytes' dequantization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdora.kernels import configs, launcher

_BLOCK_M = 64 if not configs.INTERPRETED else 16

# The largest rank read from the packed bytes: one tile of C then spans all of r, so each tile of W is dequantized
# once. Above it each column block of C dequantizes its tiles of W again; there the dequantized weight and cuBLAS's
# GEMM are faster (8B shape, r = 384, one H100, the training step: 1.48-1.54x QLoRA's read from the bytes in three
# column blocks, 1.15x from the dequantized weight; docs/benchmarks.md).
MAX_RANK = 128


def _block_n(r: int) -> int:
    return min(MAX_RANK, max(16, triton.next_power_of_2(r)))


@triton.jit
def _cross_4bit_kernel(
    p_q, p_absmax, p_code, p_a, p_c, p_absmax2, p_code2, p_offset,
    rows, d_in, r, row0, stride_cm, stride_cj,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, OUT_DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``C[rows, r-slice] = W[row0 + rows] a^T`` float32 from the packed bytes; ``BLOCK_K`` divides ``BLOCKSIZE``,
    which divides ``d_in``: a tile's row lies in one quantization block."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # [BLOCK_M] rows of this chunk
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)  # [BLOCK_N] columns of C (rows of a)
    offs_h = tl.arange(0, BLOCK_K // 2).to(tl.int64)  # [BLOCK_K / 2] bytes of a tile's row
    mask_m = offs_m < rows
    mask_n = offs_n < r
    first = (row0 + offs_m) * d_in  # [BLOCK_M] flat index of each row's first element
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, d_in, BLOCK_K):
        block = (first + k) // BLOCKSIZE  # [BLOCK_M]
        if NESTED:
            b_u8 = tl.load(p_absmax + block, mask=mask_m, other=0).to(tl.int32)
            b_code = tl.load(p_code2 + b_u8)
            b_scale = tl.load(p_absmax2 + block // BLOCKSIZE2, mask=mask_m, other=0.0)
            if INTERPRETED:  # (no inline assembly there)
                b_max = b_code * b_scale
            else:  # rounded before the add, as bitsandbytes' two launches round it: never a fused multiply-add
                b_max = tl.inline_asm_elementwise(
                    "mul.rn.f32 $0, $1, $2;", "=r,r,r", [b_code, b_scale], dtype=tl.float32, is_pure=True, pack=1
                )
            b_max = b_max + tl.load(p_offset)
        else:
            b_max = tl.load(p_absmax + block, mask=mask_m, other=0.0)
        b_q = tl.load(p_q + (first + k)[:, None] // 2 + offs_h[None, :], mask=mask_m[:, None], other=0).to(tl.int32)
        w_hi = (tl.load(p_code + (b_q >> 4)) * b_max[:, None]).to(OUT_DTYPE)  # [BLOCK_M, BLOCK_K / 2]
        w_lo = (tl.load(p_code + (b_q & 15)) * b_max[:, None]).to(OUT_DTYPE)
        p_ak = p_a + offs_n[None, :] * d_in + (k + 2 * offs_h)[:, None]  # [BLOCK_K / 2, BLOCK_N]: even columns
        b_even = tl.load(p_ak, mask=mask_n[None, :], other=0.0)
        b_odd = tl.load(p_ak + 1, mask=mask_n[None, :], other=0.0)
        if INTERPRETED:  # its dot misreads a 16-bit tile computed in registers: the same products in fp32
            w_hi, w_lo = w_hi.to(tl.float32), w_lo.to(tl.float32)
            b_even, b_odd = b_even.to(tl.float32), b_odd.to(tl.float32)
        acc = tl.dot(w_hi, b_even, acc)
        acc = tl.dot(w_lo, b_odd, acc)
    p_c = p_c + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cj
    tl.store(p_c, acc, mask=mask_m[:, None] & mask_n[None, :])


_OUT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class Packed4bit:
    """A bitsandbytes 4-bit weight as the norm reads it: the packed bytes and what rebuilds ``W`` from them.

    Stands in for the dense weight in ``kernels/norm_gemm.norm_half`` (``shape``, ``dtype`` and ``device`` are the
    dense weight's); ``cross_term`` gives ``C = W a^T``."""

    __slots__ = ("q", "absmax", "code", "absmax2", "code2", "offset", "blocksize", "blocksize2", "shape", "dtype",
                 "device")  # fmt: skip

    def __init__(self, q, state):
        self.q, self.code, self.blocksize = q, state.code, state.blocksize
        self.shape, self.dtype, self.device = tuple(state.shape), state.dtype, q.device
        if state.nested:
            self.absmax, self.absmax2, self.code2 = state.absmax, state.state2.absmax, state.state2.code
            self.offset, self.blocksize2 = state.offset, state.state2.blocksize  # (a tensor: no host sync)
        else:
            self.absmax, self.absmax2, self.code2, self.offset, self.blocksize2 = state.absmax, None, None, None, 1

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def cross_term(self, a: torch.Tensor, row0: int, rows: int) -> tuple[torch.Tensor, int, int]:
        """``(C, stride over rows, stride over r)`` with ``C = W[row0 : row0 + rows] a^T`` float32 ``[rows, r]``;
        ``a``: ``[r, d_in]`` contiguous, in the weight's dtype."""
        c = torch.empty((rows, a.shape[0]), dtype=torch.float32, device=self.device)
        grid, args, flags = self.launch_args(a, c, row0, rows)
        launcher.launch_jit(_cross_4bit_kernel, grid, args, flags)
        return c, a.shape[0], 1

    def launch_args(self, a, c, row0: int, rows: int) -> tuple[tuple, tuple, dict]:
        """The cross-term kernel's ``(grid, args, flags)`` for ``C = c`` (``[rows, r]`` contiguous)."""
        r, d_in = a.shape[0], self.shape[1]
        q, absmax, code, absmax2, code2, offset = self.native_args()[:6]
        grid = (triton.cdiv(rows, _BLOCK_M), triton.cdiv(r, _block_n(r)))
        args = (q, absmax, code, a, c, absmax2, code2, offset, rows, d_in, r, row0, r, 1)
        flags = dict(BLOCKSIZE=self.blocksize, BLOCKSIZE2=self.blocksize2, NESTED=self.absmax2 is not None,
                     OUT_DTYPE=_OUT[self.dtype], INTERPRETED=configs.INTERPRETED, BLOCK_M=_BLOCK_M,
                     BLOCK_N=_block_n(r), BLOCK_K=min(64, self.blocksize))  # fmt: skip
        return grid, args, flags

    def native_args(self) -> tuple:
        """What ``flashdora.native``'s ``norm_scales_4bit`` takes before the adapters: the kernel's tensors (stand-ins
        it never reads where the weight is not double-quantized), the dense shape and dtype, and the packing."""
        nested = self.absmax2 is not None
        absmax2, code2, offset = (self.absmax2, self.code2, self.offset) if nested else (self.code,) * 3
        d_out, d_in = self.shape
        return (self.q, self.absmax, self.code, absmax2, code2, offset, d_out, d_in, self.dtype == torch.bfloat16,
                self.blocksize, self.blocksize2, nested)  # fmt: skip

    def plan(self, r: int) -> tuple | None:
        """The cross-term kernel's launch plan for ``flashdora.native`` at rank ``r`` (``launcher.jit_plan``: function,
        warps, shared memory, types, kept arguments) and its blocks, once ``launch_jit`` has compiled it for weights
        like this one; else ``None``."""
        d_out = self.shape[0]
        stand_in = torch.empty((r,), dtype=self.dtype, device=self.device)  # a plan depends on dtypes and alignment
        c = torch.empty((1,), dtype=torch.float32, device=self.device)
        _, args, flags = self.launch_args(stand_in, c, 0, d_out)  # (the integers a whole-weight call passes)
        plan = launcher.jit_plan(_cross_4bit_kernel, args, flags)
        return None if plan is None else (*plan[1:], _BLOCK_M, _block_n(r))


def packed_4bit(base) -> Packed4bit | None:
    """``base``'s weight as a ``Packed4bit``, or ``None`` where this file does not cover it: not a 4-bit layer,
    packed in a storage other than uint8, a float32 dequantized dtype, or rows that cross quantization blocks."""
    state = getattr(base.weight, "quant_state", None)
    if type(base).__name__ != "Linear4bit" or getattr(state, "quant_type", None) not in ("nf4", "fp4"):
        return None
    weight = base.weight.detach()  # (a plain tensor: Params4bit runs Python on every attribute read)
    shape = tuple(state.shape)
    if state.dtype not in _OUT or len(shape) != 2 or weight.dtype != torch.uint8 or not weight.is_contiguous():
        return None
    blocksize = state.blocksize
    if blocksize < 32 or blocksize % 32 or shape[1] % blocksize or weight.numel() * 2 != shape[0] * shape[1]:
        return None
    tensors = (state.absmax, state.code, *((state.state2.absmax, state.state2.code) if state.nested else ()))
    if any(t.device != weight.device for t in tensors):
        return None
    if state.nested and (state.state2.absmax.dtype != torch.float32 or state.absmax.dtype != torch.uint8
                         or not torch.is_tensor(state.offset)):  # fmt: skip
        return None
    return Packed4bit(weight.reshape(-1), state)
