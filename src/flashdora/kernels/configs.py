"""Autotune config lists and block-size heuristics for every flashdora kernel, in one place.

Under ``TRITON_INTERPRET=1`` each list is cut to one small config: the interpreter would otherwise "benchmark"
every config in Python, and one config skips the autotuner's timing altogether.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _pick(gpu: list[triton.Config], interpreted: triton.Config) -> list[triton.Config]:
    return [interpreted] if INTERPRETED else gpu


def bench(kernel_call, quantiles):
    """Every autotuner's timer: Triton's ``do_bench`` over 25 ms per config instead of its default 100 ms, which
    shortens a fresh process's first step and still times many calls per config (docs/host-notes.md)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


# Compose forward/backward: memory-bound tiles over [tokens, d_out]; key ["N"] (d_out), never the token count.
COMPOSE_FWD = _pick(
    [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 256}, num_warps=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 256}, num_warps=8),
        triton.Config({"BLOCK_M": 8, "BLOCK_N": 512}, num_warps=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=4),
    ],
    triton.Config({"BLOCK_M": 8, "BLOCK_N": 32}, num_warps=1),
)

# Every list below is short on purpose: a fresh machine compiles every config of every kernel in the first step,
# and the kernels here are a few percent of a step, so a config a little off the best costs less than the compile of
# one more (docs/design.md, "Cold start"; docs/host-notes.md).
# Compose with the LoRA B matmul inside (K = r): GEMM tiles; key ["N", "R"] and the operands' dtypes. One tile per
# operand kind (``prune_fused``), each the fastest of an H100 sweep at 8B shapes (docs/kernels.md).
COMPOSE_FUSED = _pick(
    [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),  # fp32 lora_B
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),  # 16-bit lora_B
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=4, num_stages=3),  # r <= 32
    ],
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}, num_warps=1, num_stages=1),
)
FUSED_SMALL_R = 32  # up to this rank, the small-rank tile


def prune_fused(configs, named_args, **kwargs):
    """The fused compose's tile for this call first (the others stay for ``FLASHDORA_AUTOTUNE=1`` to time): the
    small-rank tile up to ``FUSED_SMALL_R``; above it, the 16-bit tile when ``lora_B`` arrives in ``a``'s 16-bit
    dtype (cast first), else the float32 one (a float32 ``lora_B`` cast in registers, or float32 operands: the
    16-bit tile's operand ring is sized for 2-byte elements). The launch key holds ``r`` and both dtypes."""
    if len(configs) == 1:
        return configs
    if named_args["R"] <= FUSED_SMALL_R:
        pick = 2
    else:
        b, a = named_args["p_lora_B"].dtype, named_args["p_a"].dtype
        pick = 1 if b == a and b.itemsize == 2 else 0
    return [configs[pick], *(c for i, c in enumerate(configs) if i != pick)]


# Mixed-adapter compose (kernels/mixed.py): the fused form's GEMM tiles over [tokens, d_out], K = summed ranks;
# decoding has few tokens (BLOCK_M 16), prefill many (BLOCK_M 64: ``prune_mixed``); key ["N", "R"].
MIXED_FWD = _pick(
    [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=4, num_stages=3),
    ],
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}, num_warps=1, num_stages=1),
)
MIXED_DECODE_TOKENS = 64  # up to this many tokens a call, the decode tile


def prune_mixed(configs, named_args, **kwargs):
    """The mixed compose's decode tile for a few tokens, the prefill tile for more (the launch key says which)."""
    if len(configs) == 1:
        return configs
    decode = named_args["T"] <= MIXED_DECODE_TOKENS
    return [c for c in configs if (c.kwargs["BLOCK_M"] == 16) == decode] or configs


# The backward walks a fixed token range per program (set by the wrapper, so dg's summation order does not depend
# on the config) in steps of BLOCK_M.
COMPOSE_BWD = _pick(
    [
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=4),
        triton.Config({"BLOCK_M": 8, "BLOCK_N": 512}, num_warps=4),
    ],
    triton.Config({"BLOCK_M": 8, "BLOCK_N": 32}, num_warps=1),
)
# Tokens per backward program: a multiple of every BLOCK_M above; the split count aims at about two programs per SM
# (of 1, 2, 4, 8 and 16 timed on an H100, 2 took the least time per 8B and per 70B layer at 2048 and at 8192 tokens,
# up to 14% off the fastest at single shapes: docs/kernels.md, "Split").
COMPOSE_BWD_ROW_QUANTUM = 32
COMPOSE_BWD_TARGET_PROGRAMS_PER_SM = 2
COMPOSE_BWD_MIN_COL_BLOCK = 128  # the column block assumed when sizing the split (the smallest BLOCK_N above)

# Factored norm of float32 weights: a GEMM [d_out, d_in] x [d_in, r] with the row-dot against B in its epilogue.
# BLOCK_R (the r-slice per program) comes from norm_block_r, not the autotuner, so the partial-sum buffer's rows do
# not depend on the config; configs too big for shared memory at W's element size are shrunk by prune_norm.
NORM_FWD = _pick(
    [
        triton.Config({"BLOCK_M": 128, "BLOCK_K": 32}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_K": 32}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_K": 16}, num_warps=8, num_stages=4),
    ],
    triton.Config({"BLOCK_M": 16, "BLOCK_K": 16}, num_warps=1, num_stages=1),
)
# The epilogue of the 16-bit weights' norm (kernels/norm_gemm.py): a GEMM [rows, r] x [r, BLOCK_J] (B G on TF32)
# with the row-dot in its epilogue; key ["r"]. BLOCK_J is norm_block_r's (it sets the partial rows), not tuned. The
# first tile was the fastest of twelve (or within 0.1 us of it) on an H100 at every 8B and 70B projection shape, at
# r = 128 and 384 (docs/kernels.md).
NORM_EPILOGUE = _pick(
    [
        triton.Config({"BLOCK_M": 32, "BLOCK_G": 32}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_G": 32}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_G": 32}, num_warps=8, num_stages=3),
    ],
    triton.Config({"BLOCK_M": 16, "BLOCK_G": 16}, num_warps=1, num_stages=1),
)
# The small-rank norm of 16-bit weights (kernels/norm_small.py): [BLOCK_M rows, d_in] x [d_in, r] and [r, r] per
# program; key ["d_out", "d_in", "r"]. BLOCK_R (next_pow2(r)) is not tuned; prune_small puts the configs with
# BLOCK_M >= BLOCK_R first: every program also computes the r x r Gram matrix, which costs as much as its rows' cross
# term only once BLOCK_M >= r (docs/host-notes.md).
NORM_SMALL = _pick(
    [
        triton.Config({"BLOCK_M": 32, "BLOCK_K": 128}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    ],
    triton.Config({"BLOCK_M": 16, "BLOCK_K": 16}, num_warps=1, num_stages=1),
)


def prune_small(configs, named_args, **kwargs):
    """NORM_SMALL with the configs whose BLOCK_M is at least BLOCK_R first (stable; none dropped)."""
    block_r = kwargs.get("BLOCK_R", named_args.get("BLOCK_R", 16))
    return sorted(configs, key=lambda c: c.kwargs["BLOCK_M"] < block_r)


NORM_GRAM_BLOCK_K = 32  # K step of the in-epilogue B_rows @ G[:, r-slice] product (K = r)
NORM_SMEM_BYTES = 200 * 1024  # operand ring budget (H100 allows 227 KiB per block; the epilogue needs some too)


def norm_block_r(r: int) -> int:
    """The r-slice per program: next_pow2(r) from 16 up to 128 (wider slices hold too many accumulators)."""
    return min(128, max(16, triton.next_power_of_2(r)))


def prune_norm(configs, named_args, **kwargs):
    """Drop configs whose W/A operand ring overflows shared memory; shrink the smallest if none fits."""
    esize = named_args["p_w"].element_size()
    block_r = kwargs.get("BLOCK_R", named_args.get("BLOCK_R"))

    def smem(c):
        return c.num_stages * (c.kwargs["BLOCK_M"] + block_r) * c.kwargs["BLOCK_K"] * esize

    kept = [c for c in configs if smem(c) <= NORM_SMEM_BYTES]
    if kept:
        return kept
    c = min(configs, key=smem)
    return [triton.Config({"BLOCK_M": c.kwargs["BLOCK_M"], "BLOCK_K": 32}, num_warps=c.num_warps, num_stages=2)]


def gram_blocks(r: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K) of the split-K ``A A^T`` kernel."""
    if INTERPRETED:
        return 16, 16
    return min(64, max(16, triton.next_power_of_2(r))), 64


def gram_splits(tiles: int, d_in: int, block_k: int, device) -> int:
    """Split-K factor for ``A A^T``: about two programs per SM, at least one K block per split."""
    if device.type != "cuda":
        return min(2, triton.cdiv(d_in, block_k))
    return max(1, min(triton.cdiv(d_in, block_k), triton.cdiv(2 * sm_count(device), tiles * tiles)))


def sm_count(device) -> int:
    """Multiprocessors of a CUDA ``device`` (2 elsewhere, for the interpreter's small grids); cached."""
    if device.type != "cuda":
        return 2
    return _sm_count(device.index if device.index is not None else _current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _current_device() -> int:
    return torch.cuda.current_device()
